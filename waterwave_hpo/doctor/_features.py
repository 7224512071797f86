"""The doctor's feature checks: every feature run as the executor runs it.

Each check runs the feature end to end through :class:`~waterwave_hpo.WaterwaveExecutor` (or
the public API a trial calls) on the device given: the user's GPU, or on a machine without one,
the CPU and the simulated device. Each returns a :class:`CheckResult` with a figure; a check
whose feature cannot run here (CuPy missing on a GPU, one GPU for a multi-GPU check) is a SKIP
saying why. The CUDA variants have not run on a GPU in this project's CI (it has none).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
from torch import nn

from waterwave_hpo.doctor._report import CheckResult
from waterwave_hpo.doctor._report import CheckStatus

MIB = 1 << 20
_BATCH = 256
_WIDTH = 128


def _passed(ok: bool) -> CheckStatus:
    return CheckStatus.PASS if ok else CheckStatus.FAIL


def _mlp(dropout: float = 0.0) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(_WIDTH, _WIDTH), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(_WIDTH, 10))


def _data(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_BATCH, _WIDTH, generator=gen)
    y = torch.randint(0, 10, (_BATCH,), generator=gen)
    return x.to(device), y.to(device)


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss = torch.zeros(())
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    return float(loss.item())


def _wait_for_failure_of_trial_0(study: Any, timeout_s: float = 120.0) -> None:
    """Return once trial 0 is told FAIL (a neighbour waits here).

    The executor counts a failed trial's neighbours before telling the study, so trial 0 always
    fails beside one (and is re-run), however fast the neighbour is.
    """
    import time

    import optuna

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if study.get_trials(deepcopy=False)[0].state is optuna.trial.TrialState.FAIL:
            return
        time.sleep(0.01)


def _executor(device: torch.device, k: int, **kwargs: Any) -> Any:
    import waterwave_hpo as ww

    return ww.WaterwaveExecutor(str(device), trials_per_device=k, record_trial_attrs=True, **kwargs)


# -- HOME plans beside a neighbour --------------------------------------------------------------


def _plain_peak_bytes(device: torch.device) -> int:
    import waterwave_hpo as ww
    from waterwave_hpo.planning import PLANNERS
    from waterwave_hpo.planning import remove_memory_plan
    from waterwave_hpo.planning import step_profile_of

    model = _mlp(dropout=0.1).to(device)
    ww.fit_memory(model, 1 << 40, example_input=_data(device)[0], planner="none")
    profile = step_profile_of(model)
    remove_memory_plan(model)
    plan = PLANNERS["none"](
        profile, 0, bandwidth_bytes_per_s=ww.planning.DEFAULT_BANDWIDTH_BYTES_PER_S, seed=0
    )
    return int(plan.prediction.peak_bytes)


#: Most relative error (:func:`~waterwave_hpo.doctor._checks.relative_error`) between a
#: planned model's output or gradients and the same model's without a plan. A plan promises
#: the same numbers: a swap copies activations exactly, a recompute replays its forward's
#: random draws; a recompute that drew new dropout masks is off by far more.
PLAN_REL_TOL = 1e-5


def _planned_against_plain(
    planned: nn.Module, plain: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> float:
    """The largest relative error of ``planned``'s output and gradients against ``plain``'s.

    One forward and backward of each from the same seed (dropout draws the same masks), on the
    same batch; call it while no other thread draws from torch's generator.
    """
    from waterwave_hpo.doctor._checks import relative_error

    results = []
    for model in (planned, plain):
        torch.manual_seed(1234)
        model.zero_grad(set_to_none=True)
        out = model(x)
        nn.functional.cross_entropy(out, y).backward()  # type: ignore[no-untyped-call]
        grads = [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]
        results.append((out.detach().cpu(), grads))
        model.zero_grad(set_to_none=True)
    (out_a, grads_a), (out_b, grads_b) = results
    if len(grads_a) != len(grads_b):
        return float("inf")
    errors = [relative_error(out_a, out_b)]
    errors += [relative_error(a, b) for a, b in zip(grads_a, grads_b, strict=True)]
    return max(errors)


def check_home_plans(device: torch.device) -> CheckResult:
    """A co-hosted study in which a trial that does not fit beside its neighbour gets a plan.

    Two trials of a 4-block MLP with dropout, registered with ``fit_trial_memory``, under
    ``memory_plan="home"`` and a budget of 1.5 plain footprints. What a plan promises is
    checked, not which kind of unit it chose (on a fast GPU recompute rightly beats swap): the
    second trial runs with a HOME plan that moves at least one unit (swap or recompute) while
    the first holds its footprint; the plan's predicted peak fits the memory it was made for,
    what the first left (less than the budget: the neighbour's footprint is counted); one step
    of the planned model gives the same output and gradients as the same model without a plan
    (relative error at most :data:`PLAN_REL_TOL`, dropout from one seed, the neighbour waiting
    meanwhile); and both complete. The figure is the number of units the plan swaps or
    recomputes.
    """
    import copy

    import optuna

    import waterwave_hpo as ww
    from waterwave_hpo.executor import trial_memory_plan

    plain = _plain_peak_bytes(device)
    budget = plain + plain // 2
    registered = threading.Event()
    compared = threading.Event()
    both = threading.Barrier(2, timeout=120)
    seen: dict[str, float] = {}

    def objective(trial: optuna.trial.Trial) -> float:
        dev = ww.current().device
        torch.manual_seed(trial.number)
        x, y = _data(dev)
        try:
            if trial.number == 1:
                registered.wait(timeout=120)
            model = _mlp(dropout=0.1).to(dev)
            reference = copy.deepcopy(model) if trial.number == 1 else None
            model = ww.fit_trial_memory(model, example_input=x)
            if trial.number == 0:
                registered.set()
            both.wait()  # both hold their footprints at once
            if reference is not None:
                # The neighbour waits: nothing else draws from torch's generator meanwhile.
                seen["error"] = _planned_against_plain(model, reference, x, y)
                del reference
            elif trial.number == 0:
                compared.wait(timeout=120)
        except BaseException:
            both.abort()  # the neighbour fails at once rather than at the barrier's timeout
            raise
        finally:
            registered.set()
            if trial.number == 1:
                compared.set()
        return _train(model, x, y, 3)

    study = optuna.create_study()
    _executor(device, 2, memory_budget_bytes=budget, memory_plan="home").optimize(
        study, objective, n_trials=2
    )
    states = [t.state.name for t in study.trials]
    plan = trial_memory_plan(study.trials[1]) if len(study.trials) > 1 else None
    choices = list(plan.choices.values()) if plan is not None else []
    moved = sum(c != "keep" for c in choices)
    room = 0 if plan is None else plan.budget_bytes  # what the neighbour left it
    fits = plan is not None and plan.predicted_peak_bytes <= room < budget
    error = seen.get("error", float("inf"))
    ok = states == ["COMPLETE", "COMPLETE"] and moved > 0 and fits and error <= PLAN_REL_TOL
    peak = "-" if plan is None else f"{plan.predicted_peak_bytes / MIB:.2f} MiB"
    return CheckResult(
        "home_plans",
        _passed(ok),
        float(moved),
        "units swapped or recomputed",
        f"2 co-hosted trials on {device}, budget {budget / MIB:.1f} MiB (1.5 plain footprints): "
        f"states {states}; the second trial's plan: {choices.count('swap')} swap, "
        f"{choices.count('recompute')} recompute, {choices.count('keep')} keep, predicted "
        f"peak {peak} for the {room / MIB:.2f} MiB its neighbour left; its output and "
        f"gradients against the same model without a plan: relative error {error:.1e}; pass: "
        f"both complete, a plan that moves a unit, fits the room, and gives the same numbers "
        f"(<= {PLAN_REL_TOL})",
    )


# -- an OOM raised inside backward --------------------------------------------------------------


class _OutOfMemoryInBackward(torch.autograd.Function):
    """Identity forward; its backward raises ``torch.OutOfMemoryError``.

    As an allocation in backward (autograd's worker thread on CUDA) does on a full device.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (raised inside backward by the doctor)")


def check_oom_in_backward(device: torch.device) -> CheckResult:
    """An OOM raised inside ``backward`` beside a neighbour: the trial is re-run and completes.

    The figure is the number of re-runs (pass: exactly one, and every configuration complete).
    """
    import optuna

    import waterwave_hpo as ww

    both = threading.Barrier(2, timeout=120)
    attempts: dict[int, int] = {}
    lock = threading.Lock()

    def objective(trial: optuna.trial.Trial) -> float:
        dev = ww.current().device
        width = trial.suggest_categorical("width", [_WIDTH])
        x, y = _data(dev)
        model = _mlp().to(dev)
        with lock:
            attempts[width] = attempts.get(width, 0) + 1
            first = trial.number == 0
        if trial.number < 2:
            both.wait()  # it fails beside a neighbour, so it is re-run
        if first:
            out = _OutOfMemoryInBackward.apply(model(x))  # type: ignore[no-untyped-call,unused-ignore]
            nn.functional.cross_entropy(out, y).backward()  # type: ignore[no-untyped-call]
        if trial.number == 1:
            _wait_for_failure_of_trial_0(trial.study)
        return _train(model, x, y, 2)

    study = optuna.create_study()
    _executor(device, 2).optimize(study, objective, n_trials=2)
    trials = study.trials
    reruns = [t for t in trials if t.system_attrs.get("waterwave:retry_of") is not None]
    states = [t.state.name for t in trials]
    ok = states == ["FAIL", "COMPLETE", "COMPLETE"] and len(reruns) == 1
    return CheckResult(
        "oom_in_backward",
        _passed(ok),
        float(len(reruns)),
        "re-runs",
        f"2 co-hosted trials on {device}, trial 0 raises torch.OutOfMemoryError inside backward: "
        f"states {states}; pass: the failed attempt FAIL, re-run once, all configurations complete",
    )


# -- CuPy out of memory inside a trial ----------------------------------------------------------


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def check_cupy_oom(device: torch.device) -> CheckResult:
    """CuPy running out of memory inside a trial beside a neighbour: re-run, not fatal.

    On a GPU with CuPy: trial 0 asks CuPy (routed to the trial's pool account) for more than
    the device has. Elsewhere: trial 0 exhausts a simulated pool and raises what
    ``pool.cupy_allocator()`` raises, CuPy's ``OutOfMemoryError`` chained from the pool's
    ``PoolOutOfMemoryError`` (the pool's error alone without CuPy). The figure is the number of
    re-runs (pass: one, and both configurations complete).
    """
    import optuna

    import waterwave_hpo as ww
    from waterwave_hpo.memory import PoolOutOfMemoryError
    from waterwave_hpo.memory import StreamAwarePool

    cupy = _cupy()
    if device.type == "cuda" and cupy is None:
        return CheckResult(
            "cupy_oom", CheckStatus.SKIP, None, "", "CuPy is not installed (waterwave-hpo[cuda12])"
        )
    both = threading.Barrier(2, timeout=120)

    def run_out(dev: torch.device) -> None:
        if dev.type == "cuda":
            total = int(torch.cuda.get_device_properties(dev).total_memory)
            cupy.empty(2 * total, dtype=cupy.uint8)  # raises CuPy's OutOfMemoryError
            return
        pool = StreamAwarePool(capacity_bytes=4 * MIB, backend="sim")
        try:
            try:
                pool.allocate(8 * MIB, stream=1)
            except PoolOutOfMemoryError as exc:
                if cupy is None:
                    raise
                stats = pool.stats()
                raise cupy.cuda.memory.OutOfMemoryError(
                    8 * MIB, stats.reserved_bytes, stats.capacity_bytes
                ) from exc
        finally:
            pool.close()

    def objective(trial: optuna.trial.Trial) -> float:
        dev = ww.current().device
        x = trial.suggest_float("x", 0, 1)
        if trial.number < 2:
            both.wait()
        if trial.number == 0:
            run_out(dev)
        if trial.number == 1:
            _wait_for_failure_of_trial_0(trial.study)
        return x

    study = optuna.create_study()
    _executor(device, 2).optimize(study, objective, n_trials=2)
    trials = study.trials
    reruns = [t for t in trials if t.system_attrs.get("waterwave:retry_of") is not None]
    states = [t.state.name for t in trials]
    ok = states == ["FAIL", "COMPLETE", "COMPLETE"] and len(reruns) == 1
    how = (
        "CuPy asked for twice the device"
        if device.type == "cuda"
        else "simulated pool exhausted, "
        + ("CuPy's OutOfMemoryError" if cupy is not None else "PoolOutOfMemoryError (no CuPy)")
    )
    return CheckResult(
        "cupy_oom",
        _passed(ok),
        float(len(reruns)),
        "re-runs",
        f"2 co-hosted trials on {device}, trial 0 runs out of memory in CuPy ({how}): states "
        f"{states}; pass: re-run once, not fatal, all configurations complete",
    )


# -- LaySA in bf16 ------------------------------------------------------------------------------


def _laysa_bf16_worker(rank: int, world: int, backend: str, store_path: str, out: str) -> None:
    """One rank: the bf16 MLP under DDP + LaySA, 5 steps; writes its last loss (or error)."""
    import json

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from waterwave_hpo.distributed import laysa

    result: dict[str, Any] = {}
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        store = dist.FileStore(store_path, world)  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        try:
            torch.manual_seed(0)
            net = nn.Sequential(
                nn.Linear(33, 67), nn.ReLU(), nn.Linear(67, 67), nn.ReLU(), nn.Linear(67, 3)
            ).to(device=device, dtype=torch.bfloat16)
            ids = [rank] if backend == "nccl" else None
            model = DistributedDataParallel(net, device_ids=ids)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            laysa(model, density=0.03, optimizer=opt)
            gen = torch.Generator().manual_seed(1 + rank)
            x = torch.randn(64, 33, generator=gen).to(device=device, dtype=torch.bfloat16)
            y = torch.randint(0, 3, (64,), generator=gen).to(device)
            loss = torch.zeros(())
            for _ in range(5):
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(x).float(), y)
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
            result["loss"] = float(loss.item())
        finally:
            dist.destroy_process_group()
    except Exception as error:  # reported by the parent as the check's failure
        result["error"] = f"{type(error).__name__}: {error}"[:500]
    with open(out, "w") as f:
        json.dump(result, f)


def check_laysa_bf16(device: torch.device) -> CheckResult:
    """LaySA trains a bf16 model under DDP: NCCL on GPUs, gloo on the CPU.

    ``nn.Sequential(Linear(33, 67), ReLU, Linear(67, 67), ReLU, Linear(67, 3))`` in bfloat16
    (odd sizes: layer slices start at offsets that are not multiples of 4 bytes), LaySA at
    density 0.03, 5 steps, in fresh processes: two ranks on two GPUs when present, one rank
    (a one-process NCCL group) on one GPU, two gloo ranks on the CPU. The figure is rank 0's
    last loss (pass: every rank finite, no error).
    """
    import json
    import os
    import tempfile

    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        return CheckResult("laysa_bf16", CheckStatus.SKIP, None, "", "torch.distributed missing")
    if device.type == "cuda":
        if not dist.is_nccl_available():
            return CheckResult("laysa_bf16", CheckStatus.SKIP, None, "", "NCCL is not available")
        backend, world = "nccl", min(2, int(torch.cuda.device_count()))
    else:
        backend, world = "gloo", 2
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        store = os.path.join(tmp, "store")
        procs = []
        context = mp.get_context("spawn")
        for rank in range(world):
            proc = context.Process(
                target=_laysa_bf16_worker, args=(rank, world, backend, store, outs[rank])
            )
            proc.start()
            procs.append(proc)
        for proc in procs:
            proc.join(timeout=300)
            if proc.is_alive():
                proc.kill()
        results = []
        for rank, path in enumerate(outs):
            try:
                with open(path) as f:
                    results.append(json.load(f))
            except (OSError, ValueError):
                results.append(
                    {"error": f"rank {rank} wrote no result (exit {procs[rank].exitcode})"}
                )
    errors = [r["error"] for r in results if "error" in r]
    losses = [r.get("loss", math.nan) for r in results]
    ok = not errors and all(math.isfinite(v) for v in losses)
    return CheckResult(
        "laysa_bf16",
        _passed(ok),
        losses[0] if math.isfinite(losses[0]) else None,
        "loss after 5 steps",
        f"{world} {backend} rank(s) on {device}, bf16 MLP 33-67-67-3, LaySA density 0.03: "
        f"{'; '.join(errors) if errors else f'losses {losses}'}; pass: every rank trains "
        "(finite loss, no error)",
    )


# -- a fused batch ------------------------------------------------------------------------------


def check_fused_batch(device: torch.device, k: int = 4) -> CheckResult:
    """``WaterwaveExecutor(fuse=K)`` runs K trials as one fused model; each is told on its own.

    A ``ww.batched`` objective fuses K MLPs (``fusion.fuse``), trains them with the fused
    optimizer and returns each model's loss. The figure is the size of the largest batch run
    (pass: K, and all K trials complete with finite values).
    """
    import optuna

    import waterwave_hpo as ww
    from waterwave_hpo import fusion

    sizes: list[int] = []

    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[float]:
        dev = ww.current().device
        lrs = [t.suggest_float("lr", 1e-3, 1e-1, log=True) for t in trials]
        sizes.append(len(trials))
        fused = fusion.fuse([_mlp() for _ in trials]).to(dev)
        opt = fusion.optimizer(torch.optim.SGD, fused, [{"lr": lr} for lr in lrs])
        x, y = _data(dev)
        losses = torch.zeros(len(trials))
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            out = fused(x)  # (K, B, 10)
            losses = fusion.per_model_loss(nn.functional.cross_entropy, out, y)
            losses.sum().backward()  # type: ignore[no-untyped-call]
            opt.step()
        return [float(v) for v in losses.tolist()]

    study = optuna.create_study()
    ww.WaterwaveExecutor(str(device), trials_per_device=1, fuse=k).optimize(
        study, objective, n_trials=k
    )
    values = [t.value for t in study.trials]
    ok = (
        max(sizes, default=0) == k
        and all(t.state is optuna.trial.TrialState.COMPLETE for t in study.trials)
        and all(v is not None and math.isfinite(v) for v in values)
    )
    return CheckResult(
        "fused_batch",
        _passed(ok),
        float(max(sizes, default=0)),
        "trials per fused batch",
        f"fuse={k} on {device}: batches {sizes}, states "
        f"{[t.state.name for t in study.trials]}; pass: one batch of {k}, all complete",
    )


# -- every visible GPU --------------------------------------------------------------------------


def check_every_gpu(device: torch.device) -> CheckResult:
    """A small training step on every visible GPU, each through its pool.

    On a GPU machine: a matmul and its gradient on each visible device (its pool, installed or
    pass-through, serves it), results checked against the CPU. Without a GPU: the simulated
    counterpart, one simulated pool per device of a two-device machine, allocate, free, account
    each. The figure is the number of devices that passed.
    """
    if device.type != "cuda":
        return _every_sim_device(2)
    from waterwave_hpo.memory import allocator_info

    n = int(torch.cuda.device_count())
    good = []
    for index in range(n):
        dev = torch.device("cuda", index)
        w = torch.randn(64, 64, generator=torch.Generator().manual_seed(index))
        x = w.to(dev).requires_grad_()
        (x @ x).sum().backward()  # type: ignore[no-untyped-call]
        want = (torch.ones(64, 64) @ w.T) + (w.T @ torch.ones(64, 64))
        if x.grad is not None and torch.allclose(x.grad.cpu(), want, atol=1e-3, rtol=1e-3):
            good.append(index)
    info = allocator_info()
    return CheckResult(
        "every_gpu",
        _passed(len(good) == n),
        float(len(good)),
        "devices",
        f"{n} visible GPU(s), passed: {good}; pools installed {list(info.pool_devices)}, "
        f"pass-through {list(info.passthrough_devices)}, unavailable "
        f"{sorted(info.unavailable_devices)}; pass: every device",
    )


def _every_sim_device(n: int) -> CheckResult:
    from waterwave_hpo.memory import StreamAwarePool

    good = 0
    for index in range(n):
        pool = StreamAwarePool(capacity_bytes=8 * MIB, backend="sim", device=index)
        try:
            with pool.open_account(str(index), streams=(1,)) as account:
                ptr = pool.allocate(MIB, stream=1)
                charged = account.stats().allocated_bytes
                pool.free(ptr, stream=1)
            good += int(charged == MIB and pool.stats().allocated_bytes == 0)
        finally:
            pool.close()
    return CheckResult(
        "every_gpu",
        _passed(good == n),
        float(good),
        "devices",
        f"no GPU: {n} simulated devices, one pool each, allocate + free charged to an account "
        "on each; pass: every device. Not a GPU figure.",
    )


# -- the late path: CUDA initialised before the executor ----------------------------------------

#: Slots and trials of the late-path check's study, and how long its process may take.
LATE_K = 2
LATE_TRIALS = 4
LATE_TIMEOUT_S = 300.0
#: The late-path check's process: CUDA (a tensor on the device) before anything of
#: waterwave_hpo is imported, as a script that moved its data to the GPU first; then the study.
_LATE_CHILD = """
import json, sys
import torch
touched = torch.ones(1 << 18, device=sys.argv[1])
from waterwave_hpo.doctor._features import late_path_study
print(json.dumps(late_path_study(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))), flush=True)
"""


def late_path_study(device: str, k: int, n_trials: int) -> dict[str, Any]:
    """A ``k``-slot study of ``n_trials`` small CNNs through the executor (``memory_pool="auto"``).

    Run by the late-path check in a process whose CUDA a tensor initialised first. The first
    ``k`` trials start together and end one after another while the others still run (each
    trains a few more steps than the one before): the moment a trial's memory goes back while
    its neighbours' is in use. Returns the trials' states, how PyTorch's allocator ended up
    (swapped to the pool or not, its backend) and what the executor warned.
    """
    import warnings

    import optuna

    import waterwave_hpo as ww
    from waterwave_hpo.memory import allocator_swapped

    together = threading.Barrier(k, timeout=120)

    def objective(trial: optuna.trial.Trial) -> float:
        dev = ww.current().device
        torch.manual_seed(trial.number)
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 10)
        ).to(dev)
        gen = torch.Generator().manual_seed(trial.number)
        x = torch.randn(32, 3, 16, 16, generator=gen).to(dev)
        y = torch.randint(0, 10, (32,), generator=gen).to(dev)
        if trial.number < k:
            together.wait()
        return _train(model, x, y, 3 + 6 * (trial.number % k))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        study = optuna.create_study()
        _executor(torch.device(device), k).optimize(study, objective, n_trials=n_trials)
    cuda = device.startswith("cuda")
    return {
        "states": [t.state.name for t in study.trials],
        "swapped": allocator_swapped(),
        "backend": torch.cuda.get_allocator_backend() if cuda else "cpu",
        "warnings": sorted(
            {
                f"{type(w.message).__name__}: {w.message}"[:300]
                for w in caught
                if "Experimental" not in type(w.message).__name__
            }
        ),
    }


def late_path_result(device: str, k: int = LATE_K, n_trials: int = LATE_TRIALS) -> CheckResult:
    """Run :func:`late_path_study` in a fresh process whose CUDA was initialised first; judge it.

    A fresh process, since this one installed the pool before CUDA started (the doctor's
    first check); a native abort there (a C++ exception thrown in a destructor is
    ``std::terminate``) is a FAIL naming the signal, never the doctor's own end.
    """
    import json
    import os
    from pathlib import Path
    import signal
    import subprocess
    import sys
    import tempfile

    import waterwave_hpo

    # The child imports the package this process runs, wherever it is started from: `-c` puts
    # the working directory first on sys.path, and in a source checkout that is the unbuilt
    # tree (no pool library), not the installed package.
    package_root = str(Path(waterwave_hpo.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    why = ""
    outcome: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="waterwave-doctor-") as cwd:
            done = subprocess.run(
                [sys.executable, "-c", _LATE_CHILD, device, str(k), str(n_trials)],
                capture_output=True,
                text=True,
                timeout=LATE_TIMEOUT_S,
                cwd=cwd,
                env=env,
            )
    except subprocess.TimeoutExpired:
        why = f"the study's process did not end within {LATE_TIMEOUT_S:.0f} s"
    else:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])[-400:]
        if done.returncode < 0:
            try:
                name = signal.Signals(-done.returncode).name
            except ValueError:
                name = f"signal {-done.returncode}"
            why = f"the study's process was killed by {name}: {tail}"
        elif done.returncode != 0:
            why = f"the study's process exited with code {done.returncode}: {tail}"
        else:
            try:
                outcome = json.loads(done.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                why = f"the study's process printed no result: {tail}"
    states = outcome.get("states", [])
    ok = not why and states == ["COMPLETE"] * n_trials
    if outcome:
        ran = (
            f"states {states}; PyTorch's allocator swapped to the pool: {outcome['swapped']}, "
            f"backend {outcome['backend']!r}; the executor warned: "
            f"{'; '.join(outcome['warnings']) or 'nothing'}"
        )
    else:
        ran = why
    return CheckResult(
        "late_path",
        _passed(ok),
        float(states.count("COMPLETE")),
        "trials complete",
        f"a {k}-slot study of {n_trials} trials on {device} in a process that put a tensor "
        f"there before it imported waterwave_hpo: {ran}; pass: the process ends and every "
        "trial is COMPLETE",
    )


def check_late_path(device: torch.device) -> CheckResult:
    """A study after the user's script touched CUDA first completes (the late path).

    On a GPU: :func:`late_path_result` (a fresh process: a tensor moved to the device, then a
    ``LATE_K``-slot study through the executor with ``memory_pool="auto"``). Without a GPU it
    is a SKIP: the late path is a CUDA context made before the executor set the device up, and
    on the CPU the executor has no pool to install, so no study there can take it.
    """
    if device.type != "cuda":
        return CheckResult(
            "late_path",
            CheckStatus.SKIP,
            None,
            "",
            "no GPU: the late path is a CUDA context made before the executor sets the device "
            "up; on the CPU the executor installs no pool, so no study here can take it",
        )
    return late_path_result(str(device))


# -- a worker process that crashes -------------------------------------------------------------

_CRASHING_TRIAL = 1
_WAIT_S = 60.0


def _wait_until(study: Any, ready: Any) -> bool:
    """Poll the study (through the worker's relay) until ``ready(trials)``, at most 60 s."""
    import time

    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        if ready(study.get_trials(deepcopy=False)):
            return True
        time.sleep(0.02)
    return False


def crash_one_worker(trial: Any) -> float:
    """The worker-crash check's objective: trial 1 kills its worker with a segmentation fault.

    Module-level, so a spawned worker process imports it. Each trial records its process, its
    slot and when its objective started, and runs a small step on its device. Trial 1 crashes
    while trial 0 runs beside it; trial 0 then holds its slot until trial 2 has started, so
    trial 2 runs in the crashed trial's slot, in a new worker.
    """
    import ctypes
    import os
    import time

    from optuna.trial import TrialState

    import waterwave_hpo as ww

    context = ww.current()
    trial.set_user_attr("pid", os.getpid())
    trial.set_user_attr("slot", context.slot)
    trial.set_user_attr("started", time.time())
    x = trial.suggest_float("x", -1.0, 1.0)
    w = torch.full((64, 64), x, device=context.device)
    value = float((w @ w).sum().item())
    study = trial.study
    if trial.number == 0:
        _wait_until(
            study,
            lambda ts: (
                len(ts) > 2
                and ts[_CRASHING_TRIAL].state is TrialState.FAIL
                and "started" in ts[2].user_attrs
            ),
        )
    if trial.number == _CRASHING_TRIAL:
        _wait_until(study, lambda ts: "started" in ts[0].user_attrs)  # a neighbour is running
        if study.user_attrs.get("crash") == "exit":
            os._exit(3)  # a process that ends without a signal (the check must then fail)
        ctypes.string_at(0)  # reads address 0: SIGSEGV in native code
    return value


def check_worker_crash(
    device: torch.device, k: int = 2, n_trials: int = 4, crash: str = "segfault"
) -> CheckResult:
    """A worker process killed by a segmentation fault fails its trial alone.

    A study of ``n_trials`` trials with ``isolation="process"`` and ``k`` slots on the device:
    trial 1 segfaults in native code (``ctypes.string_at(0)``) while its worker holds the
    device and trial 0 runs beside it. Pass: trial 1 is FAIL with the signal (SIGSEGV) in its
    fail reason, every other trial COMPLETE (trial 0 included), and trial 2 ran in trial 1's
    slot in another process (a new worker). The figure is the seconds from trial 1's FAIL to
    trial 2's objective starting: the replacement worker's start-up. ``crash="exit"`` makes
    trial 1 ``os._exit(3)`` instead (no signal: the check must fail; its own test).
    """
    import optuna

    import waterwave_hpo as ww
    from waterwave_hpo.host import ATTR_FAIL_REASON

    study = optuna.create_study()
    study.set_user_attr("crash", crash)
    with ww.WaterwaveExecutor(
        str(device), trials_per_device=k, record_trial_attrs=True, isolation="process"
    ) as executor:  # its workers end with the check
        executor.optimize(study, crash_one_worker, n_trials=n_trials)
    trials = study.get_trials(deepcopy=False)
    crashed, after = trials[_CRASHING_TRIAL], trials[_CRASHING_TRIAL + 1]
    reason = str(crashed.system_attrs.get(ATTR_FAIL_REASON, ""))
    others = [t for t in trials if t.number != _CRASHING_TRIAL]
    same_slot = after.user_attrs.get("slot") == crashed.user_attrs.get("slot")
    new_pid = after.user_attrs.get("pid") not in (None, crashed.user_attrs.get("pid"))
    replaced = same_slot and new_pid
    respawn_s = None
    if crashed.datetime_complete is not None and "started" in after.user_attrs:
        respawn_s = float(after.user_attrs["started"]) - crashed.datetime_complete.timestamp()
    ok = (
        crashed.state is optuna.trial.TrialState.FAIL
        and "SIGSEGV" in reason
        and len(trials) == n_trials
        and all(t.state is optuna.trial.TrialState.COMPLETE for t in others)
        and replaced
    )
    return CheckResult(
        "worker_crash",
        _passed(ok),
        None if respawn_s is None else round(respawn_s, 3),
        "s to a new worker's trial",
        f"isolation='process', {k} slots on {device}, trial {_CRASHING_TRIAL} crashes beside "
        f"trial 0: states {[t.state.name for t in trials]}, reason {reason[:160]!r}; trial "
        f"{_CRASHING_TRIAL} slot {crashed.user_attrs.get('slot')} pid "
        f"{crashed.user_attrs.get('pid')}, trial {after.number} slot "
        f"{after.user_attrs.get('slot')} pid {after.user_attrs.get('pid')}; pass: trial "
        f"{_CRASHING_TRIAL} FAIL with SIGSEGV in its reason, the others COMPLETE, trial "
        f"{after.number} in its slot in a new worker",
    )


#: The feature checks, in the order the doctor runs them (name, check of a device).
FEATURE_CHECKS = (
    ("home_plans", check_home_plans),
    ("oom_in_backward", check_oom_in_backward),
    ("cupy_oom", check_cupy_oom),
    ("laysa_bf16", check_laysa_bf16),
    ("fused_batch", check_fused_batch),
    ("every_gpu", check_every_gpu),
    ("late_path", check_late_path),
    ("worker_crash", check_worker_crash),
)
