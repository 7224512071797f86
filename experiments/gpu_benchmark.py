"""Co-hosting on one GPU against what users already have: one command, one table, one folder.

Every way of running N trials of one search on one device, measured in one run, each figure a
ratio to one trial at a time (temporal sharing) measured in the same run:

* ``temporal``: ``study.optimize(n_jobs=1)`` (one at a time: the baseline);
* ``optuna-nj``: Optuna's own ``study.optimize(n_jobs=K)`` (threads, one stream, PyTorch's caching
  allocator: what users do today);
* ``ww-pool`` / ``ww-torch`` / ``ww-async``: :class:`waterwave_hpo.WaterwaveExecutor` with K
  slots (one CUDA stream each), on the stream-aware pool (``memory_pool="auto"`` in a fresh
  process), on PyTorch's caching allocator (``memory_pool="off"``) and on PyTorch's
  ``backend:cudaMallocAsync`` (the driver's stream-ordered pool; ``memory_pool="off"``); each
  with NodeGroup gates off and on (``ww.pipeline`` on the model: ``+gates``);
* ``ww-torch+modeB``: ``ww-torch`` at K = ``--ks[0]``, light demand, in a process of its own with
  ``TORCH_CUDNN_USE_HEURISTIC_MODE_B=1`` (torch reads it once, at the process's first cuDNN
  convolution): cuDNN's heuristic mode B alone, on PyTorch's allocator, beside ``ww-torch`` (the
  pool's rows once ran with it and cost 11-67% against PyTorch's);
* ``ww-late``: the executor with ``memory_pool="auto"`` at K = ``--ks[0]``, light demand, in a
  process whose CUDA a tensor initialised first (the late path, as a script that moved its data
  to the GPU before building the executor): whatever the executor then does, the row records
  that it completed, how fast, on what allocator and what the executor said;
* ``fused``: the executor with ``fuse=K`` (HFTA's horizontal fusion, ``waterwave_hpo.fusion``);
* ``processes``: the executor with ``isolation="process"`` (a worker process per slot, each on
  PyTorch's caching allocator: spatial sharing).

for K = 4 and 8, on two workloads (a small CNN, batch 128, and the bench's ResNet-style CNN,
batch 64, both on 32x32 inputs, 16 trials x 100 SGD steps), at light demand and at high demand:
the cap is ``--high-factor`` (2.5) times one trial's measured peak (reserved bytes), so K
trials' summed peaks do not fit. At high demand every method is capped at the same bytes, the
bytes of the segments its allocator took from the device (reserved, cached ones included),
above what the process still held once its caches were released (``held_bytes``, outside the
cap): PyTorch's caching allocator by ``torch.cuda.set_per_process_memory_fraction((held + cap) /
total)`` (its limit counts reserved bytes); the pool by its capacity,
``StreamAwarePool.set_capacity(held + cap)`` (its capacity counts the segments it holds);
``processes`` by the executor's leases (``memory_budget_bytes=cap``: each worker's allocator
bounded by the fraction of its lease, ``cap / K``); the executor also gets
``memory_budget_bytes=cap`` (its scheduler's budget). ``cudaMallocAsync`` is the exception, and
its rows say so: there the fraction limits the bytes PyTorch's live tensors hold (allocated),
not what the driver's pool reserves. Per row: trials completed, out-of-memory attempts and
failed trials, wall seconds, ``cap_bytes`` (null at light demand), ``peak_bytes`` (the most
device bytes the row's trials held at once, reserved, above ``held_bytes``: PyTorch's
``max_memory_reserved``, the pool's ``peak_reserved_bytes``; for ``processes`` the sum of each
worker's own peak, an upper bound; ``peak_source`` names which), and, where the pool runs, the
pool's counters and its ``driver_stats()`` over the row. The physical anchors come first, on the
same GPU: a matmul's TFLOP/s and a pinned host-to-device copy's GB/s. The pool's torch shim is
built before the first group starts, so its compile time never lands in a row.

Each configuration that needs its own allocator, environment or a fresh CUDA context runs in
its own process (a *group*: anchors, torch, pool, modeb, late, async, processes); a row that
fails records its error and the next row runs; a group that dies (a native abort included) or
overruns is recorded and the next group runs. Every row has a share of the time budget
(``--budget-s``, default 450 s, so that the whole run, start-up included, ends within 8
minutes); a row that reaches the end of its share stops starting trials, its running trials
stop at their next step, and the row says ``cut``. The ratio of a row is its completed trials
per second over temporal's, so a cut row still compares.

On the CPU (``--device cpu``) the pool's rows run too: a simulated device stands in for the GPU
(``StreamAwarePool(backend="sim")``, capped like the GPU's pool): every tensor an op makes in a
trial is allocated from it on the trial's own virtual stream and freed with the tensor (the
data stays in host memory), so the pool group's code runs end to end with its cap, counters,
``driver_stats`` and ``peak_bytes``; the row's ``stand_in`` says so, and none of its figures is
a GPU figure. The anchors' solo peaks come from that simulated device too; the other rows'
``peak_bytes`` is the process's peak resident memory growth over the row (Linux ``VmHWM``,
reset through ``/proc/self/clear_refs``). The CUDA-only rows (``ww-async``, ``+modeB``,
``ww-late``) are skipped there, saying why; their ``cap_bytes`` is still set.

Run on a GPU (one command):
    python experiments/gpu_benchmark.py --out results-gpu/
On the CPU at toy scale (what CI runs; tiny models, a few steps, K=2):
    python experiments/gpu_benchmark.py --device cpu --toy --out /tmp/gpubench/

Writes into ``--out`` (created; an existing folder is refused unless it is empty or this script
made it): ``results.json`` (machine, versions, arguments, anchors, capacities, the shim's build,
every row), ``results.csv`` (one line per row), ``table.md`` (the printed table) and
``group-<name>.log`` (each group process's output). Needs torch and Optuna and the installed
package; not Ray.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import gc
import importlib
import json
import logging
import os
from pathlib import Path
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any
import warnings
import weakref

_T0 = time.time()  # the run's start: torch's import below counts against the budget

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

MARKER = ".gpu_benchmark"
ASYNC_CONF = "backend:cudaMallocAsync"
_OOM_ATTR = "gpubench:oom"
_CUT_ATTR = "gpubench:cut"
_STEPS_ATTR = "gpubench:steps"
_START_ATTR = "gpubench:start"
_PEAK_ATTR = "gpubench:peak_bytes"
_PID_ATTR = "gpubench:pid"
#: The executor's record of why a trial failed (``record_trial_attrs=True``); Optuna's own key
#: for ``study.optimize(catch=...)`` is ``fail_reason``.
_FAIL_REASON = "waterwave:fail_reason"
#: Read by torch once per process, at its first cuDNN convolution (ATen/native/ConvUtils.h).
MODE_B_ENV = "TORCH_CUDNN_USE_HEURISTIC_MODE_B"


# -- the plan: workloads, rows, groups ------------------------------------------------------------


@dataclasses.dataclass
class WorkloadDef:
    """One workload as every row trains it.

    Attributes:
        name: ``small-cnn`` or ``resnet``.
        batch_size: Images per step.
        image_size: Height and width of the (synthetic, 3-channel) images.
        width: Channels of the first convolution.
        blocks: Residual blocks per stage (``resnet`` only).
    """

    name: str
    batch_size: int
    image_size: int
    width: int
    blocks: int = 0


@dataclasses.dataclass
class Row:
    """One configuration at one workload and one demand, and what it measured.

    Attributes:
        key: Unique name, ``<workload>/<setting>/<label>[+gates][+modeB][ K=k]``.
        group: The process it runs in (``torch``, ``pool``, ``modeb``, ``late``, ``async``,
            ``processes``).
        workload: The workload's name.
        setting: ``light`` or ``high``.
        label: The configuration (``temporal``, ``optuna-nj``, ``ww-pool``, ...).
        k: Trials at once.
        gates: NodeGroup gates on the model (``ww.pipeline``).
        mode_b: Run in a process with ``TORCH_CUDNN_USE_HEURISTIC_MODE_B=1``.
        share_s: Seconds of the budget this row may take (set by its group at run time).
        status: ``ok``, ``cut`` (stopped at the end of its share), ``error``, ``skipped`` (not
            for this device, or not selected) or ``pending`` (not run yet).
        wall_s: Seconds from the first trial's start to the last trial's end (the ``optimize``
            call).
        first_trial_s: Seconds from the ``optimize`` call to the first objective call (for
            processes: the workers' start-up).
        completed: Trials told COMPLETE.
        failed: Trials told FAIL (out-of-memory attempts re-run by the executor included).
        oom: Attempts that ran out of device memory.
        trials_per_s: ``completed / wall_s``.
        steps_per_s: SGD steps per second of the completed trials and of the trials the row's
            cut stopped (steps of attempts that failed otherwise are not counted).
        x_temporal: ``steps_per_s`` over temporal's at the same workload and demand (for a row
            that was not cut: its completed trials per second over temporal's).
        allocator: The allocator the trials ran on.
        bound: How the row's memory was bounded (the cap, and what counts against it).
        cap_bytes: High demand: the bytes every method of this workload is capped at (reserved,
            above ``held_bytes``); the same for every row of the workload at high demand, also
            on rows not run. ``None`` at light demand.
        held_bytes: Device bytes the process still held at the row's start, once its caches
            were released (outside the cap; the stand-in's on the CPU); ``None`` where not
            measured.
        peak_bytes: The most device bytes the row's trials held at once, reserved, above
            ``held_bytes``; ``peak_source`` says how it was measured. ``None`` when the row did
            not run.
        peak_source: Where ``peak_bytes`` comes from (PyTorch's ``max_memory_reserved``, the
            pool's ``peak_reserved_bytes``, the workers' own peaks summed, the simulated device,
            or the process's peak resident memory growth on the CPU).
        cudnn_mode_b: Whether ``TORCH_CUDNN_USE_HEURISTIC_MODE_B=1`` was set in the row's
            process at its end (``None`` on the CPU, where cuDNN does not run).
        stand_in: What stood in for the GPU (the simulated device on the CPU), else ``""``.
        note: Anything the reader must know (the error, why not run, what was cut).
        pool: The pool's counters over the row (where the pool runs), else ``{}``.
        driver: The pool's ``driver_stats()`` over the row (where the pool runs), else ``{}``.
    """

    key: str
    group: str
    workload: str
    setting: str
    label: str
    k: int
    gates: bool = False
    mode_b: bool = False
    share_s: float = 0.0
    status: str = "pending"
    wall_s: float | None = None
    first_trial_s: float | None = None
    completed: int = 0
    failed: int = 0
    oom: int = 0
    trials_per_s: float | None = None
    steps_per_s: float | None = None
    x_temporal: float | None = None
    allocator: str = ""
    bound: str = ""
    cap_bytes: int | None = None
    held_bytes: int | None = None
    peak_bytes: int | None = None
    peak_source: str = ""
    cudnn_mode_b: bool | None = None
    stand_in: str = ""
    note: str = ""
    pool: dict[str, Any] = dataclasses.field(default_factory=dict)
    driver: dict[str, Any] = dataclasses.field(default_factory=dict)


#: The configurations a row can be.
LABELS = (
    "temporal",
    "optuna-nj",
    "ww-torch",
    "ww-pool",
    "ww-async",
    "ww-late",
    "fused",
    "processes",
)
#: Group order: ``torch`` first (its process measures the anchors, which size the high demand).
GROUPS = ("torch", "pool", "modeb", "late", "async", "processes")
#: Groups whose rows need CUDA, and why (said on their rows on the CPU).
CUDA_ONLY = {
    "async": "CUDA only: cudaMallocAsync serves CUDA memory",
    "modeb": "CUDA only: cuDNN's heuristic mode B applies to cuDNN's convolutions",
    "late": "CUDA only: the late path is a CUDA context initialised before the executor",
}
#: The environment each group's process adds to the driver's.
GROUP_ENV = {"async": {"PYTORCH_CUDA_ALLOC_CONF": ASYNC_CONF}, "modeb": {MODE_B_ENV: "1"}}
#: What stands in for the GPU in the pool group on the CPU (said on its rows).
SIM_STAND_IN = (
    "no GPU: a simulated device (StreamAwarePool(backend='sim'), capped like the GPU's pool) "
    "stood in: every tensor an op made in a trial was allocated from it on the trial's virtual "
    "stream and freed with the tensor; the data stayed in host memory. Not a GPU figure"
)
#: Expected cost of a row relative to temporal at the same workload (sizes the time shares).
_WEIGHT = {"temporal": 1.0, "processes": 1.6}
_WEIGHT_CO_HOSTED = 0.6


def _row_weight(row: Row, plan: dict[str, Any]) -> float:
    """The row's expected cost in temporal-rows of the cheapest workload."""
    return _WEIGHT.get(row.label, _WEIGHT_CO_HOSTED) * float(plan["workload_weight"][row.workload])


def workloads(toy: bool) -> list[WorkloadDef]:
    """The two workloads (tiny ones with ``toy``)."""
    if toy:
        return [WorkloadDef("small-cnn", 8, 16, 4), WorkloadDef("resnet", 4, 16, 16, 1)]
    return [WorkloadDef("small-cnn", 128, 32, 32), WorkloadDef("resnet", 64, 32, 32, 2)]


def plan_rows(device_type: str, ks: list[int], settings: list[str], toy: bool) -> list[Row]:
    """Every row of the run, in the order the groups run them (temporal first in ``torch``)."""
    cuda = device_type == "cuda"
    rows: list[Row] = []
    for wl in workloads(toy):
        for setting in settings:

            def add(
                group: str,
                label: str,
                k: int,
                gates: bool = False,
                mode_b: bool = False,
                wl: WorkloadDef = wl,
                setting: str = setting,
            ) -> None:
                name = f"{label}{'+gates' if gates else ''}{'+modeB' if mode_b else ''}" + (
                    f" K={k}" if k > 1 else ""
                )
                key = f"{wl.name}/{setting}/{name}"
                rows.append(Row(key, group, wl.name, setting, label, k, gates, mode_b))

            add("torch", "temporal", 1)
            for k in ks:
                add("torch", "optuna-nj", k)
            for k in ks:
                for gates in (False, True):
                    add("torch", "ww-torch", k, gates)
            for k in ks:
                add("torch", "fused", k)
            for k in ks:
                for gates in (False, True):
                    add("pool", "ww-pool", k, gates)
            if setting == "light" and (not toy or wl.name == "small-cnn"):
                add("modeb", "ww-torch", ks[0], mode_b=True)
                add("late", "ww-late", ks[0])
            for k in ks:
                add("async", "ww-async", k)
            if not toy or (wl.name == "small-cnn" and setting == settings[0]):
                add("processes", "processes", ks[0])
    for row in rows:
        if not cuda and row.group in CUDA_ONLY:
            row.status, row.note = "skipped", CUDA_ONLY[row.group]
        if not cuda and row.group == "pool":
            row.stand_in = SIM_STAND_IN
    return rows


# -- models and one trial's training ---------------------------------------------------------------


def build_model(wl: WorkloadDef) -> nn.Module:
    """The workload's model, ``[B, 3, S, S] -> [B, 10]``, on the CPU.

    ``small-cnn``: two convolution + ReLU + max-pool stages (``width``, ``2 width`` channels) and a
    linear head. ``resnet``: ``waterwave-hpo bench``'s ResNet-style CNN
    (:func:`waterwave_hpo.bench.build_resnet`: stem, ``blocks`` residual blocks per stage at
    ``width`` and ``2 width`` channels, a stride-2 convolution between, global pooling, linear
    head) with ``width`` and ``blocks`` fixed, so every trial has one structure (what fusion
    needs). The bench package imports without pandas, which a bare GPU machine may lack.
    """
    w = wl.width
    if wl.name == "resnet":
        import optuna

        from waterwave_hpo.bench import build_resnet

        return build_resnet(optuna.trial.FixedTrial({"width": w, "blocks": wl.blocks}))
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * w * (wl.image_size // 4) ** 2, 10),
    )


def make_batches(wl: WorkloadDef, device: Any, seed: int, n: int = 4) -> list[tuple[Any, Any]]:
    """``n`` synthetic batches ``([B, 3, S, S] float32, [B] int64)`` on ``device``, seeded."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(wl.batch_size, 3, wl.image_size, wl.image_size, generator=g)
        y = torch.randint(0, 10, (wl.batch_size,), generator=g)
        out.append((x.to(device), y.to(device)))
    return out


class RowCut(RuntimeError):
    """The row's share of the time budget ran out while this trial trained."""


def suggest(trial: Any) -> dict[str, float]:
    """The search space: SGD's learning rate and momentum (the architecture is fixed)."""
    return {
        "lr": trial.suggest_float("lr", 1e-3, 0.1, log=True),
        "momentum": trial.suggest_float("momentum", 0.0, 0.95),
    }


def is_oom(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error (the executor's test, else torch's type)."""
    try:
        from waterwave_hpo.executor import is_out_of_memory

        return bool(is_out_of_memory(error))  # type: ignore[arg-type,unused-ignore]
    except ImportError:  # pragma: no cover - an older or newer package layout
        return isinstance(error, torch.cuda.OutOfMemoryError)


def train_trial(
    trial: Any,
    wl: WorkloadDef,
    steps: int,
    deadline: float,
    gates: bool,
    worker_peak: bool = False,
) -> float:
    """Train one trial for ``steps`` SGD steps on its device; return the last loss.

    The device is the executor's (``ww.current()``) inside the executor, else the one set by
    the row (``_DEVICE``). On the CPU, where a simulated device stands in for the GPU
    (``_STAND_IN``), every tensor the trial makes is allocated from it on the trial's virtual
    stream (:class:`SimDeviceMemory`). Raises :class:`RowCut` at the first step past
    ``deadline``; an out-of-memory error is marked on the trial (``gpubench:oom``) and raised.
    ``worker_peak``: record the process's own peak (``gpubench:peak_bytes``, with its pid:
    a worker process runs one trial at a time).
    """
    import waterwave_hpo as ww

    trial.set_user_attr(_START_ATTR, time.time())
    ctx = ww.current_or_none()
    device = ctx.device if ctx is not None else torch.device(_DEVICE[0])
    stand_in = _STAND_IN[0] if device.type == "cpu" else None
    stream = (ctx.slot if ctx is not None else 0) + 1  # a virtual stream per slot
    peak = ProcessPeak(device) if worker_peak else None
    hp = suggest(trial)
    try:
        with SimDeviceMemory(stand_in, stream) if stand_in is not None else _no_scope():
            torch.manual_seed(trial.number)
            model = build_model(wl).to(device)
            if gates:
                model = ww.pipeline(model)
            opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=hp["momentum"])
            batches = make_batches(wl, device, seed=trial.number)
            loss = torch.zeros(())
            for step in range(steps):
                if time.time() > deadline:
                    trial.set_user_attr(_CUT_ATTR, True)
                    trial.set_user_attr(_STEPS_ATTR, step)
                    raise RowCut(f"the row's time share ended at step {step} of {steps}")
                x, y = batches[step % len(batches)]
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
            return float(loss.detach().item())
    except Exception as error:
        if is_oom(error):
            trial.set_user_attr(_OOM_ATTR, True)
        raise
    finally:
        if peak is not None:
            trial.set_user_attr(_PEAK_ATTR, peak.read())
            trial.set_user_attr(_PID_ATTR, os.getpid())


def train_fused(trials: list[Any], wl: WorkloadDef, steps: int, deadline: float) -> list[Any]:
    """Train a batch of trials as one fused model (HFTA); one entry per trial (loss or error)."""
    import waterwave_hpo as ww
    from waterwave_hpo import fusion

    for t in trials:
        t.set_user_attr(_START_ATTR, time.time())
    device = ww.current().device
    hps = [suggest(t) for t in trials]
    try:
        models = []
        for t in trials:
            torch.manual_seed(t.number)
            models.append(build_model(wl))
        fused = fusion.fuse(models).to(device)
        opt = fusion.optimizer(torch.optim.SGD, fused, hps)
        per = [make_batches(wl, device, seed=t.number) for t in trials]
        stacked = [
            (torch.stack([b[i][0] for b in per]), torch.stack([b[i][1] for b in per]))
            for i in range(len(per[0]))
        ]
        losses = torch.zeros(len(trials))
        for step in range(steps):
            if time.time() > deadline:
                for t in trials:
                    t.set_user_attr(_CUT_ATTR, True)
                    t.set_user_attr(_STEPS_ATTR, step)
                cut = RowCut(f"the row's time share ended at step {step} of {steps}")
                return [cut for _ in trials]
            xs, ys = stacked[step % len(stacked)]
            opt.zero_grad(set_to_none=True)
            out = fused(xs, stacked=True)
            losses = fusion.per_model_loss(
                nn.functional.cross_entropy, out, ys, target_stacked=True
            )
            losses.sum().backward()  # type: ignore[no-untyped-call]
            opt.step()
        return [float(v) for v in losses.detach().tolist()]
    except Exception as error:
        if is_oom(error):
            for t in trials:
                t.set_user_attr(_OOM_ATTR, True)
        raise


_DEVICE = ["cpu"]
#: The simulated device standing in for the GPU in the pool group on the CPU, else ``None``.
_STAND_IN: list[Any] = [None]
#: Capacity of the stand-in at light demand: a simulated 4 GiB device.
SIM_DEVICE_BYTES = 4 << 30
#: A tensor moved to the device first thing in the ``late`` group (the user's data), kept.
_TOUCHED: list[Any] = []
#: What the executor said in this process (warnings, its log), for the ``late`` rows.
_SAID: list[str] = []


# -- device memory: the CPU's stand-in for the GPU, peaks, caps ---------------------------------


@contextlib.contextmanager
def _no_scope() -> Any:
    yield


def _storage_address(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr()) if t.layout is torch.strided else None
    except (RuntimeError, NotImplementedError):  # a tensor without storage
        return None


def _release_block(pool: Any, charged: dict[int, int], lock: Any, address: int, block: int) -> None:
    with lock:
        if charged.get(address) == block:
            del charged[address]
    try:
        pool.free(block)
    except Exception:  # the pool closed first (the process is ending)
        pass


class SimDeviceMemory(TorchDispatchMode):  # type: ignore[no-untyped-call,unused-ignore]
    """Every tensor an op makes in this scope is allocated from a simulated device too.

    The CPU's stand-in for the GPU's pool: each new storage an op returns (not a view of one
    of its inputs) gets a block of its size from ``pool`` (a ``sim``
    :class:`~waterwave_hpo.memory.StreamAwarePool`) on ``stream``, freed (in ``stream``'s order)
    when the storage dies; each op is one simulated kernel on ``stream``, complete when the op
    returns (the CPU ran it by then). So the pool's
    rules (its capacity, cross-stream reuse, counters, driver calls) see the trial's real
    allocation sizes and lifetimes, while the data stays in host memory. When the pool is out
    of memory the op's output is dropped and ``torch.OutOfMemoryError`` raised, as PyTorch
    raises for a device. Thread-local, as every dispatch mode (one per trial thread); the
    trial's backward, which runs in its own thread on the CPU, is in scope too.

    Args:
        pool: A ``sim`` pool.
        stream: The trial's virtual stream (any nonzero int).
    """

    def __init__(self, pool: Any, stream: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call,unused-ignore]
        self.pool = pool
        self.stream = stream
        # A live host storage's address -> its block; per scope, so that no lock is a module
        # global (the processes rows pickle this script's functions to their workers).
        self._charged: dict[int, int] = {}
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        seen = {
            _storage_address(t)
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                address = _storage_address(t)
                if address is not None and address not in seen:
                    seen.add(address)
                    self._charge(t, address)
        # One simulated kernel, done when the op returns (a CPU op has run by then), so frees
        # on one stream are seen complete by the others, as a GPU's short kernels soon are.
        self.pool.sim.submit(self.stream)
        self.pool.sim.finish(self.stream)
        return out

    def _charge(self, t: torch.Tensor, address: int) -> None:
        from waterwave_hpo.memory import PoolOutOfMemoryError

        storage = t.untyped_storage()
        nbytes = int(storage.nbytes())
        with self._lock:
            if nbytes == 0 or address in self._charged:
                return
        try:
            block = self.pool.allocate(nbytes, self.stream)
        except PoolOutOfMemoryError as error:
            raise torch.OutOfMemoryError(
                f"the simulated device standing in for the GPU is out of memory: {error}"
            ) from error
        with self._lock:
            self._charged[address] = block
        weakref.finalize(
            storage, _release_block, self.pool, self._charged, self._lock, address, block
        )


def _proc_status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes (``None`` off Linux)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


class ProcessPeak:
    """This process's peak device bytes from now on: reserved on CUDA, resident on the CPU.

    On CUDA: PyTorch's peak reserved bytes (its peaks reset now). On the CPU: the growth of the
    process's peak resident memory (Linux ``VmHWM``, reset now through ``/proc/self/clear_refs``;
    where it cannot be reset, ``ru_maxrss``, which grows only past the process's earlier peak).
    """

    def __init__(self, device: Any) -> None:
        self.device = device
        self.start = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.source = "torch.cuda.max_memory_reserved"
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.resettable = _proc_status_bytes("VmHWM") is not None
        except OSError:
            self.resettable = False
        if self.resettable:
            self.start = _proc_status_bytes("VmRSS") or 0
            self.source = "the process's peak resident memory growth (VmHWM), host memory"
        else:
            import resource

            self.start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            self.source = "the process's ru_maxrss growth (only past its earlier peak)"

    def read(self) -> int:
        """Bytes: the peak since this object was made (above the start on the CPU)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_reserved(self.device))
        if self.resettable:
            return max((_proc_status_bytes("VmHWM") or 0) - self.start, 0)
        import resource

        return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.start, 0)


# -- the group process: runs its rows, one JSON line each ---------------------------------------


def _release_cached(device: Any) -> int:
    """Free PyTorch's cached blocks and cuBLAS workspaces on ``device``; bytes still reserved.

    cuBLAS keeps a workspace per (handle, stream) allocated through PyTorch's allocator, outside
    ``empty_cache``; earlier rows' threads and streams would otherwise count against the next
    row's bound. Under the pool, ``empty_cache`` gives its wholly free segments back (no trial
    runs between rows) and the bytes reserved are the pool's.
    """
    torch.cuda.synchronize(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    try:
        return int(torch.cuda.memory_reserved(device))
    except Exception:  # an allocator without the stat (a pluggable one may refuse it)
        return 0


def _memory_fraction(device: Any, capacity: int | None, held: int) -> str:
    """Bound PyTorch's allocator to ``capacity`` bytes above ``held``; say how.

    ``None``: unbound (fraction 1). The fraction is ``(held + capacity) / total``: PyTorch's
    caching allocator refuses a new segment once its reserved bytes would pass it.
    """
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = 1.0 if capacity is None else min(1.0, (held + capacity) / total)
    try:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
    except (RuntimeError, AttributeError) as error:
        return f"set_per_process_memory_fraction failed: {error}"
    if capacity is None:
        return ""
    return f"set_per_process_memory_fraction({fraction:.6f}): {capacity} B above {held} B held"


def _serving_pool(device: Any) -> Any:
    """The stream-aware pool serving this process's trials on ``device``, or ``None``.

    On CUDA the pool installed as PyTorch's allocator (or its pass-through pool), else one the
    executor put under the trials' streams; on the CPU the simulated device standing in.
    """
    if device.type != "cuda":
        return _STAND_IN[0]
    try:
        from waterwave_hpo import memory

        index = device.index or 0
        for name in ("installed_pool", "device_pool", "routed_pool"):
            lookup = getattr(memory, name, None)  # the pool's API is changing: look, not assume
            pool = lookup(index) if lookup is not None else None
            if pool is not None:
                return pool
    except Exception:  # its counters are a bonus, never a failure
        return None
    return None


def _install_pool(device: Any) -> str:
    """Install a stream-aware pool as PyTorch's allocator on ``device``; ``""`` or why not.

    What the executor's ``memory_pool="auto"`` does at its first ``optimize`` (and the
    executor then reuses the installed pool), done here so that the row's cap is on the pool
    before its first trial.
    """
    try:
        from waterwave_hpo import memory

        memory.use_pool(memory.StreamAwarePool(backend="cuda", device=device.index or 0))
    except Exception as error:  # the row runs on, and says the pool was not installed
        return f"{type(error).__name__}: {error}"[:300]
    return ""


def _allocator_swapped() -> bool:
    try:
        from waterwave_hpo import memory

        return bool(memory.allocator_swapped())
    except Exception:
        return False


def _pool_counters(pool: Any) -> dict[str, Any] | None:
    """The pool's counters (and its mutex's), or ``None`` without a pool."""
    if pool is None:
        return None
    try:
        out = dict(dataclasses.asdict(pool.stats()))
        lock_stats = getattr(pool, "lock_stats", None)
        if lock_stats is not None:
            out.update({f"lock_{k}": v for k, v in dataclasses.asdict(lock_stats()).items()})
        return out
    except Exception:  # the pool's API is changing: its counters are a bonus, never a failure
        return None


def _driver_counters(pool: Any) -> dict[str, Any] | None:
    """The pool's ``driver_stats()``, or ``None`` without a pool (or without the method)."""
    try:
        return dict(dataclasses.asdict(pool.driver_stats())) if pool is not None else None
    except Exception:
        return None


def _pool_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """Counters over a row: differences of counts, the end value of levels and peaks."""
    if not after:
        return {}
    levels = ("bytes", "segments", "capacity")
    out: dict[str, Any] = {}
    for k, v in after.items():
        if not isinstance(v, (int, float)):
            continue
        if before is None or any(s in k for s in levels) or k not in before:
            out[k] = v
        else:
            out[k] = v - before[k]
    return out


def _allocator_name(device: Any, row: Row) -> str:
    if row.label == "processes":
        return "workers' own" + (" (PyTorch's caching allocator)" if device.type == "cuda" else "")
    if device.type != "cuda":
        return "sim pool (stand-in)" if _STAND_IN[0] is not None else "cpu"
    if _allocator_swapped():
        return "waterwave-pool"
    if _serving_pool(device) is not None:
        return "pytorch-caching, waterwave-pool under the trials' streams"
    try:
        backend = torch.cuda.get_allocator_backend()
    except (AttributeError, RuntimeError):
        backend = "native"
    return "cudaMallocAsync" if backend == "cudaMallocAsync" else "pytorch-caching"


class RowMemory:
    """A row's device memory: what was held at its start, its cap, its peak and the pool's work.

    Made just before the row's trials start: releases the caches, measures what the process
    still holds (``held``), caps the row's allocator at ``cap`` bytes above it (see the module
    docstring: the fraction for PyTorch's allocators, the capacity for the pool, leases for
    processes) and resets the peaks. :meth:`finish` fills the row's memory fields.
    """

    def __init__(self, device: Any, row: Row, cap: int | None) -> None:
        self.device = device
        self.row = row
        self.cap = cap
        self.cuda = device.type == "cuda"
        self.install_error = ""
        if row.group == "pool" and self.cuda and not _allocator_swapped():
            self.install_error = _install_pool(device)  # the warm-up did not: the cap needs it
        pool: Any = None if row.label == "processes" else _serving_pool(device)
        self.pool = pool
        # The pool serves every tensor (PyTorch's allocator on CUDA, the stand-in on the CPU).
        self.pool_serves = self.pool is not None and (not self.cuda or _allocator_swapped())
        self.held: int | None = None
        self.process_peak: ProcessPeak | None = None
        bounds = []
        gc.collect()  # an earlier row's trials in reference cycles: freed, not counted as held
        if row.label == "processes":
            if cap is not None:
                bounds.append(
                    f"memory_budget_bytes={cap}: a lease of {cap // row.k} B per worker, its "
                    "PyTorch allocator bounded by set_per_process_memory_fraction(lease / total)"
                    " (reserved bytes, the worker's context outside)"
                )
        elif self.cuda:
            self.held = _release_cached(device)
            if self.pool_serves:
                pool.set_capacity(None if cap is None else self.held + cap)
                if cap is not None:
                    bounds.append(
                        f"pool.set_capacity({self.held + cap}): {cap} B of segments above "
                        f"{self.held} B held"
                    )
                pool.reset_peaks()
            else:
                # PyTorch's own allocators (the pool group's too, if its pool is not installed)
                if row.group in ("torch", "pool", "async", "modeb"):
                    bound = _memory_fraction(device, cap, self.held)
                    if bound and row.group == "async":
                        bound += (
                            " (cudaMallocAsync: the limit counts the bytes PyTorch's live "
                            "tensors hold, not what the driver's pool reserves)"
                        )
                    if bound:
                        bounds.append(bound)
                torch.cuda.reset_peak_memory_stats(device)
        elif self.pool_serves:  # the CPU's stand-in
            pool.release_cached()
            self.held = int(pool.stats().reserved_bytes)
            pool.set_capacity(SIM_DEVICE_BYTES if cap is None else self.held + cap)
            pool.reset_peaks()
            if cap is not None:
                bounds.append(
                    f"stand-in pool.set_capacity({self.held + cap}): {cap} B above "
                    f"{self.held} B held"
                )
        else:
            self.process_peak = ProcessPeak(device)
            if cap is not None:
                bounds.append("not bounded (CPU: no device memory to cap)")
        self.bound = "; ".join(bounds)
        self.counters = _pool_counters(self.pool)
        self.driver = _driver_counters(self.pool)

    def finish(self, study: Any) -> None:
        """Fill the row's ``cap_bytes``, ``held_bytes``, ``peak_bytes``, ``pool``, ``driver``."""
        row = self.row
        row.cap_bytes = self.cap
        row.held_bytes = self.held
        if row.label == "processes":
            per_worker: dict[Any, int] = {}
            for t in study.trials:
                if _PEAK_ATTR in t.user_attrs:
                    pid = t.user_attrs.get(_PID_ATTR)
                    per_worker[pid] = max(per_worker.get(pid, 0), int(t.user_attrs[_PEAK_ATTR]))
            if per_worker:
                row.peak_bytes = sum(per_worker.values())
                what = "max_memory_reserved" if self.cuda else "peak resident memory growth"
                row.peak_source = (
                    f"each worker's own {what} over its trials, summed over {len(per_worker)} "
                    "workers (an upper bound of what they held at once)"
                )
        elif self.pool_serves:
            held = self.held or 0
            row.peak_bytes = int(self.pool.stats().peak_reserved_bytes) - held
            row.peak_source = (
                "the pool's peak_reserved_bytes"
                if self.cuda
                else "the simulated device's peak_reserved_bytes (the CPU's stand-in)"
            )
        elif self.cuda:
            row.peak_bytes = int(torch.cuda.max_memory_reserved(self.device)) - (self.held or 0)
            row.peak_source = "torch.cuda.max_memory_reserved" + (
                " (cudaMallocAsync: the driver pool's reserved high-water mark)"
                if row.group == "async"
                else ""
            )
        elif self.process_peak is not None:
            row.peak_bytes = self.process_peak.read()
            row.peak_source = self.process_peak.source
        if self.pool is not None:
            row.pool = _pool_delta(self.counters, _pool_counters(self.pool))
            row.driver = _pool_delta(self.driver, _driver_counters(self.pool))


def run_row(row: Row, plan: dict[str, Any], deadline: float) -> None:
    """Run one row in this process, fill its measured fields."""
    import optuna

    import waterwave_hpo as ww

    device = torch.device(plan["device"])
    if row.label not in LABELS:
        raise ValueError(f"row.label={row.label!r}: not a configuration; one of {LABELS}")
    wl = WorkloadDef(**next(w for w in plan["workloads"] if w["name"] == row.workload))
    steps = int(plan["steps"])
    n = int(plan["trials"])
    high = row.setting == "high"
    capacity = plan["capacity_bytes"].get(row.workload) if high else None
    if high and capacity is None:
        raise RuntimeError("no capacity for the high demand: the anchors group did not size it")
    memory = RowMemory(device, row, capacity)
    bounds = [memory.bound] if memory.bound else []
    executor_kwargs: dict[str, Any] = {}
    if row.label.startswith("ww-") or row.label in ("fused", "processes"):
        executor_kwargs["memory_pool"] = "auto" if row.label in ("ww-pool", "ww-late") else "off"
        if capacity is not None:
            executor_kwargs["memory_budget_bytes"] = int(capacity)
            if row.label != "processes":
                bounds.append(f"memory_budget_bytes={capacity}")
    row.bound = "; ".join(bounds)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=plan["seed"]))
    timeout = max(deadline - time.time(), 0.001)
    start = time.time()
    if row.label in ("temporal", "optuna-nj"):
        _DEVICE[0] = str(device)

        def objective(trial: Any) -> float:
            return train_trial(trial, wl, steps, deadline, row.gates)

        study.optimize(objective, n_trials=n, n_jobs=row.k, timeout=timeout, catch=(Exception,))
    elif row.label == "fused":

        def fused_objective(trials: list[Any]) -> list[Any]:
            return train_fused(trials, wl, steps, deadline)

        executor = ww.WaterwaveExecutor(
            devices=str(device),
            trials_per_device=1,
            fuse=row.k,
            record_trial_attrs=True,
            **executor_kwargs,
        )
        executor.optimize(
            study, ww.batched(fused_objective), n_trials=n, timeout=timeout, catch=(Exception,)
        )
    else:
        gates = row.gates
        worker_peak = row.label == "processes"

        def ww_objective(trial: Any) -> float:
            return train_trial(trial, wl, steps, deadline, gates, worker_peak)

        if row.label == "processes":
            executor_kwargs["isolation"] = "process"
            if device.type == "cuda":
                pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
                row.note = (
                    "MPS runs: kernels of the workers can overlap"
                    if os.path.exists(os.path.join(pipe, "control"))
                    else "MPS not running: the workers time-slice the GPU"
                )
        executor = ww.WaterwaveExecutor(
            devices=str(device), trials_per_device=row.k, record_trial_attrs=True, **executor_kwargs
        )
        executor.optimize(study, ww_objective, n_trials=n, timeout=timeout, catch=(Exception,))
    if device.type == "cuda" and row.label != "processes":
        torch.cuda.synchronize(device)
    row.wall_s = time.time() - start
    starts = [float(t.user_attrs[_START_ATTR]) for t in study.trials if _START_ATTR in t.user_attrs]
    row.first_trial_s = min(starts) - start if starts else None
    states = [t.state for t in study.trials]
    row.completed = sum(s == optuna.trial.TrialState.COMPLETE for s in states)
    row.failed = sum(s == optuna.trial.TrialState.FAIL for s in states)
    row.oom = sum(bool(t.user_attrs.get(_OOM_ATTR)) for t in study.trials)
    cut = any(t.user_attrs.get(_CUT_ATTR) for t in study.trials) or row.completed < n
    steps_done = steps * row.completed + sum(
        int(t.user_attrs.get(_STEPS_ATTR, 0))
        for t in study.trials
        if t.state != optuna.trial.TrialState.COMPLETE
    )
    if row.wall_s > 0:
        row.trials_per_s = row.completed / row.wall_s
        row.steps_per_s = steps_done / row.wall_s
    row.allocator = _allocator_name(device, row)
    memory.finish(study)
    row.cudnn_mode_b = os.environ.get(MODE_B_ENV) == "1" if device.type == "cuda" else None
    if row.label == "ww-pool" and not memory.pool_serves:
        row.note = "the pool was not installed (the executor fell back to PyTorch's allocator)" + (
            f": {memory.install_error}" if memory.install_error else ""
        )
    if row.label == "ww-late":
        said = "; ".join(dict.fromkeys(_SAID))[:300]  # once per process: the warm-up's too
        first = f"CUDA touched first ({_TOUCHED[0].device})" if _TOUCHED else "CUDA not touched"
        row.note = f"{first}; the trials ran on {row.allocator}" + (
            f"; the executor said: {said}" if said else "; the executor said nothing"
        )
    if cut and time.time() >= deadline:
        row.status = "cut"
        row.note = (
            f"cut at its share of {row.share_s:.0f} s: {row.completed} of {n} trials completed"
            + (f"; {row.note}" if row.note else "")
        )
    else:
        row.status = "ok"
        if row.completed < n:
            reasons = {
                str(t.system_attrs.get(_FAIL_REASON, t.system_attrs.get("fail_reason", "")))[:120]
                for t in study.trials
                if t.state == optuna.trial.TrialState.FAIL
            } - {""}
            row.note = (row.note + "; " if row.note else "") + (
                f"{n - row.completed} trials did not complete"
                + (f": {sorted(reasons)[0]}" if reasons else "")
            )


def warm_up(plan: dict[str, Any], group: str) -> None:
    """First use of cuDNN/cuBLAS and each model's kernels, before any row is timed.

    In the pool group the warm-up runs inside the executor (``memory_pool="auto"``), so the pool
    is installed before anything touches CUDA, as a user's first ``optimize`` would. In the
    late group it also runs inside the executor with ``memory_pool="auto"``, after CUDA was
    touched: it is the process's first meeting with the late path.
    """
    import optuna

    import waterwave_hpo as ww

    if group == "processes":
        return  # the driver must not touch CUDA; workers start inside their row
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    far = time.time() + 3600
    for w in plan["workloads"]:
        wl = WorkloadDef(**w)
        study = optuna.create_study()
        executor = ww.WaterwaveExecutor(
            devices=plan["device"],
            trials_per_device=2,
            memory_pool="auto" if group in ("pool", "late") else "off",
        )

        def objective(trial: Any, wl: WorkloadDef = wl) -> float:
            return train_trial(trial, wl, 3, far, trial.number % 2 == 1)

        executor.optimize(study, objective, n_trials=2)


def _listen_to_the_executor() -> None:
    """Keep what the executor warns and logs in this process (``_SAID``), for the late rows."""
    shown = warnings.showwarning

    def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        if "Experimental" not in category.__name__:  # the CUDA paths' standing notice
            _SAID.append(f"{category.__name__}: {message}")
        shown(message, category, *args, **kwargs)

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            _SAID.append(f"{record.levelname}: {record.getMessage()}")

    warnings.showwarning = show
    logger = logging.getLogger("waterwave_hpo")
    logger.addHandler(Keep(logging.INFO))
    logger.setLevel(logging.INFO)


def group_main(plan_path: str, group: str, out_path: str) -> int:
    """A group process: run the group's rows within its time window, a JSON line per row."""
    plan = json.loads(Path(plan_path).read_text())
    end = float(plan["group_end"][group])
    rows = [Row(**r) for r in plan["rows"] if r["group"] == group and r["status"] == "pending"]
    out = Path(out_path)

    def emit(obj: dict[str, Any]) -> None:
        with out.open("a") as f:
            f.write(json.dumps(obj) + "\n")

    if group == "late" and plan["device"].startswith("cuda"):
        # CUDA touched first, before anything of waterwave_hpo is imported: a script that moved
        # its data to the GPU before it built the executor.
        _TOUCHED.append(torch.ones(1 << 18, device=plan["device"]))
    if group == "late":
        _listen_to_the_executor()
    if group == "pool" and plan["device"] == "cpu":
        from waterwave_hpo.memory import StreamAwarePool

        _STAND_IN[0] = StreamAwarePool(SIM_DEVICE_BYTES, backend="sim")
    if plan["device"].startswith("cuda") and group != "processes":
        _DEVICE[0] = plan["device"]
    if plan["device"] == "cpu":
        # One intra-op thread: on a busy CPU, PyTorch's OpenMP team in the main thread (where
        # temporal's n_jobs=1 runs) waits for cores the co-hosted rows' threads do not.
        torch.set_num_threads(1)
    if group == "torch" and plan.get("anchors_path"):
        try:
            anchors = measure_anchors(plan)
            Path(plan["anchors_path"]).write_text(json.dumps(anchors))
            apply_anchors(plan, anchors)
        except Exception as error:
            traceback.print_exc()
            Path(plan["anchors_path"]).write_text(
                json.dumps({"error": f"{type(error).__name__}: {error}"[:400]})
            )
    try:
        warm_up(plan, group)
    except Exception as error:
        emit({"warm_up_error": f"{type(error).__name__}: {error}"})
    weights = [_row_weight(r, plan) for r in rows]
    for i, row in enumerate(rows):
        now = time.time()
        left = max(end - now, 0.0)
        row.share_s = left * weights[i] / sum(weights[i:])
        if left <= 0.5:
            row.status = "cut"
            row.note = "not run: the group's share of the time budget was spent"
            emit(dataclasses.asdict(row))
            continue
        try:
            run_row(row, plan, now + row.share_s)
        except Exception as error:
            row.status = "error"
            row.note = f"{type(error).__name__}: {error}"[:400]
            traceback.print_exc()
        if plan["device"].startswith("cuda") and group != "processes":
            try:
                _release_cached(torch.device(plan["device"]))  # the next row starts bare
            except RuntimeError as error:  # a sticky CUDA error: the next rows will say so
                print(f"[{group}] empty_cache after {row.key}: {error}", flush=True)
        emit(dataclasses.asdict(row))
        print(f"[{group}] {row.key}: {row.status} {row.wall_s} s", flush=True)
    return 0


# -- the anchors process: the GPU's own figures and each workload's solo peak -------------------


def anchors_main(plan_path: str, out_path: str) -> int:
    """The anchors alone, in their own process (when the ``torch`` group does not run)."""
    plan = json.loads(Path(plan_path).read_text())
    if plan["device"] == "cpu":
        torch.set_num_threads(1)  # as in the groups
    Path(out_path).write_text(json.dumps(measure_anchors(plan)))
    return 0


def measure_anchors(plan: dict[str, Any]) -> dict[str, Any]:
    """Matmul TFLOP/s, host-to-device GB/s, and each workload's solo peak bytes and step time.

    Runs on PyTorch's caching allocator (the ``torch`` group's process, before its rows), so
    the peaks are what one trial alone reserves there; on the CPU, what it reserves on the
    simulated device standing in for the GPU (:func:`sim_solo_peak_bytes`).
    """
    device = torch.device(plan["device"])
    cuda = device.type == "cuda"
    result: dict[str, Any] = {"device": str(device)}
    if cuda:
        props = torch.cuda.get_device_properties(device)
        result["device_name"] = props.name
        result["total_memory_bytes"] = int(props.total_memory)
    n = 1024 if plan["toy"] else 8192
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def timed(fn: Any, reps: int) -> float:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / reps

    reps = 3 if plan["toy"] else 20
    result["matmul_tflops"] = 2 * n**3 / timed(functools.partial(torch.matmul, a, b), reps) / 1e12
    result["matmul"] = f"{n}x{n} @ {n}x{n}, {dtype}"
    if cuda:
        host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
        dev = torch.empty_like(host, device=device)
        result["h2d_gb_per_s"] = (
            host.numel() / timed(lambda: dev.copy_(host, non_blocking=True), 10) / 1e9
        )
        del host, dev
    else:
        result["h2d_gb_per_s"] = None
    del a, b
    peaks: dict[str, Any] = {}
    for w in plan["workloads"]:
        wl = WorkloadDef(**w)
        held = _release_cached(device) if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        model = build_model(wl).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        batches = make_batches(wl, device, seed=0)
        steps = 3 if plan["toy"] else 20

        def step(i: int, model: Any = model, opt: Any = opt, batches: Any = batches) -> None:
            x, y = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()

        step(0)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        if cuda:
            torch.cuda.synchronize(device)
        entry: dict[str, Any] = {"step_s": (time.perf_counter() - t0) / steps}
        if cuda:
            # Above what was held before (nothing, once the caches are released): the
            # trial's model, batches, activations, cuDNN and cuBLAS workspaces.
            entry["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
            entry["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device)) - held
        else:  # no allocator counts CPU tensors: the simulated device the pool rows run on
            entry["peak_reserved_bytes"] = sim_solo_peak_bytes(wl)
            entry["peak_source"] = "the simulated device's peak_reserved_bytes (the CPU's stand-in)"
        peaks[wl.name] = entry
        del model, opt, batches
    result["workloads"] = peaks
    if cuda:
        _release_cached(device)
        torch.cuda.reset_peak_memory_stats(device)
    return result


def sim_solo_peak_bytes(wl: WorkloadDef, steps: int = 2) -> int:
    """One trial's peak reserved bytes alone on the simulated device (the CPU's stand-in).

    What the pool rows on the CPU are capped against: a fresh model, its batches and ``steps``
    SGD steps (momentum 0.9), every tensor allocated from a ``sim`` pool of its own.
    """
    from waterwave_hpo.memory import StreamAwarePool

    pool = StreamAwarePool(SIM_DEVICE_BYTES, backend="sim")
    with SimDeviceMemory(pool, 1):
        torch.manual_seed(0)
        model = build_model(wl)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        batches = make_batches(wl, "cpu", seed=0)
        for i in range(steps):
            x, y = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
        peak = int(pool.stats().peak_reserved_bytes)
        del model, opt, batches, x, y
    return peak


def apply_anchors(plan: dict[str, Any], anchors: dict[str, Any]) -> None:
    """Size the high demand (capacity per workload) and the rows' time weights from the anchors."""
    for name, entry in anchors["workloads"].items():
        plan["capacity_bytes"][name] = int(plan["high_factor"] * entry["peak_reserved_bytes"])
        plan["workload_weight"][name] = max(entry["step_s"], 1e-6)
    base = min(plan["workload_weight"].values())
    plan["workload_weight"] = {k: v / base for k, v in plan["workload_weight"].items()}


# -- the driver: plan, run the groups, make the table ----------------------------------------------


def _prepare_out(out: Path) -> None:
    """Create ``out``, or reuse it if it is empty or this script made it; else refuse."""
    if out.exists():
        if not out.is_dir():
            raise SystemExit(f"--out={out}: exists and is not a folder; name a new folder")
        if any(out.iterdir()) and not (out / MARKER).exists():
            raise SystemExit(
                f"--out={out}: the folder exists, is not empty and was not made by this "
                "script; name a new folder (or empty this one)"
            )
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("made by experiments/gpu_benchmark.py\n")


def _child(args: list[str], env_extra: dict[str, str], timeout_s: float, log: Path) -> str:
    """Run this script as a child process; return ``""`` or why it failed."""
    env = dict(os.environ)
    env.update(env_extra)
    cmd = [sys.executable, os.path.abspath(__file__), *args]
    with log.open("a") as f:
        # Its own session, so that a group past its window is ended with the processes it
        # started (the executor's workers) and none outlives the run.
        proc = subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            return f"the group process ran past its window of {timeout_s:.0f} s and was killed"
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        how = f"exited with code {proc.returncode}"
        if proc.returncode < 0:  # a signal: a native abort (SIGABRT) or crash took it down
            try:
                how = f"was killed by {signal.Signals(-proc.returncode).name}"
            except ValueError:
                how = f"was killed by signal {-proc.returncode}"
        return f"the group process {how}: {' | '.join(tail)}"[:400]
    return ""


def prebuild_shim() -> dict[str, Any]:
    """Build the pool's torch shim now, before any group, so that no row pays its compile.

    The shim is built once per torch version into a per-user cache that every later process
    finds; importing torch here does not initialise CUDA.

    Returns:
        ``{"seconds": ..., "path": ...}``, or ``{"seconds": ..., "error": ...}`` (the pool group
        then runs without it, or fails, and says so).
    """
    t0 = time.perf_counter()
    try:
        from waterwave_hpo.memory._internal import build_shim

        return {"seconds": time.perf_counter() - t0, "path": str(build_shim())}
    except Exception as error:  # recorded; the groups meet the same error and say so
        return {"seconds": time.perf_counter() - t0, "error": f"{type(error).__name__}: {error}"}


def _read_anchors(path: Path, why: str, plan: dict[str, Any]) -> dict[str, Any]:
    """The anchors a child wrote (and the high demand sized from them), or why there are none."""
    anchors = json.loads(path.read_text()) if path.exists() else {}
    if "workloads" in anchors:
        apply_anchors(plan, anchors)
        plan["anchors_path"] = None  # measured once
    else:
        anchors = {"error": anchors.get("error") or why or "no result"}
        print(f"anchors failed: {anchors['error']}", flush=True)
    return anchors


def _versions() -> dict[str, Any]:
    import optuna

    import waterwave_hpo

    try:
        cupy = getattr(importlib.import_module("cupy"), "__version__", None)
    except Exception:  # CuPy is optional: its version is only recorded
        cupy = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "optuna": optuna.__version__,
        "waterwave_hpo": waterwave_hpo.__version__,
        "cupy": cupy,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        MODE_B_ENV: os.environ.get(MODE_B_ENV),
        "CUDA_MPS_PIPE_DIRECTORY": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
    }


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / (1 << 20):.{1 if nbytes >= 1 << 20 else 3}f}"


def format_table(rows: list[Row], n: int, anchors: dict[str, Any], device_label: str) -> str:
    """The one table: each row's ratio to temporal, trials, OOMs, fails, peak and cap, status."""
    lines = [
        f"GPU benchmark on {device_label}: {n} trials per row; x = SGD steps per second over "
        "one at a time's (same workload and demand, same run; completed and cut trials' steps); "
        "peak: the most bytes the row's trials held, reserved (results.json: peak_source); "
        "cap: the bytes every method is capped at, at high demand",
        "",
        "| workload | demand | configuration | allocator | x temporal | completed | OOM | FAIL "
        "| peak / cap MiB | pool: allocs / new segments / stream waits | status | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r.key.split("/", 2)[2]
        x = "-" if r.x_temporal is None else f"{r.x_temporal:.{2 if r.x_temporal >= 0.01 else 3}f}x"
        done = f"{r.completed}/{n}" if r.status in ("ok", "cut") else "-"
        note = r.note.replace("|", "/")[:110]
        pool = "-"
        if "num_allocs" in r.pool:
            pool = " / ".join(
                str(r.pool.get(k, "?"))
                for k in ("num_allocs", "new_segment", "stream_waits_issued")
            )
        memory = f"{_mib(r.peak_bytes)} / {_mib(r.cap_bytes)}"
        lines.append(
            f"| {r.workload} | {r.setting} | {name} | {r.allocator or '-'} | {x} | {done} "
            f"| {r.oom} | {r.failed} | {memory} | {pool} | {r.status} | {note} |"
        )
    walls = [
        f"{r.workload} {r.setting} {r.wall_s:.2f} s"
        for r in rows
        if r.label == "temporal" and r.wall_s is not None
    ]
    lines += ["", "one at a time, wall: " + (", ".join(walls) or "-")]
    tflops = anchors.get("matmul_tflops")
    gbps = anchors.get("h2d_gb_per_s")
    lines += [
        "",
        "anchors: matmul "
        + (f"{tflops:.3g} TFLOP/s ({anchors.get('matmul')})" if tflops else "-")
        + ", pinned host-to-device copy "
        + (f"{gbps:.3g} GB/s" if gbps else "- (CPU)"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="results folder (created)")
    parser.add_argument("--device", default="cuda:0", help="cuda:N (default cuda:0) or cpu")
    parser.add_argument("--toy", action="store_true", help="tiny models, few steps, K=2")
    parser.add_argument("--ks", type=int, nargs="+", help="trials at once (default 4 8; toy 2)")
    parser.add_argument("--trials", type=int, help="trials per row (default 16; toy 4)")
    parser.add_argument("--steps", type=int, help="SGD steps per trial (default 100; toy 3)")
    parser.add_argument(
        "--settings", nargs="+", default=["light", "high"], choices=["light", "high"]
    )
    parser.add_argument(
        "--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS), help="groups to run"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        help="whole run's seconds, start-up included (default 450; toy 120)",
    )
    parser.add_argument(
        "--high-factor",
        type=float,
        default=2.5,
        help="high demand's capacity in solo peaks (default 2.5: K>=3 trials do not fit)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--_group", help=argparse.SUPPRESS)
    parser.add_argument("--_anchors", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_plan", help=argparse.SUPPRESS)
    parser.add_argument("--_result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._anchors:
        return anchors_main(args._plan, args._result)
    if args._group:
        return group_main(args._plan, args._group, args._result)
    if args.out is None:
        parser.error("--out is required (a new folder for the results)")
    t_start = _T0
    budget_s = args.budget_s if args.budget_s is not None else (120.0 if args.toy else 450.0)
    run_end = t_start + budget_s
    device_type = args.device.split(":")[0]
    if device_type not in ("cuda", "cpu"):
        parser.error(f"--device={args.device}: must be cuda:N or cpu")
    if device_type == "cuda" and not torch.cuda.is_available():  # counts devices; no context
        parser.error(
            f"--device={args.device}: PyTorch sees no CUDA device here; "
            "run on a GPU, or pass --device cpu --toy for the CPU check"
        )
    out = args.out.resolve()
    _prepare_out(out)
    ks = args.ks or ([2] if args.toy else [4, 8])
    n = args.trials or (4 if args.toy else 16)
    steps = args.steps or (3 if args.toy else 100)
    rows = plan_rows(device_type, ks, args.settings, args.toy)
    for row in rows:
        if row.group not in args.groups:
            row.status, row.note = "skipped", "group not selected (--groups)"
    plan: dict[str, Any] = {
        "device": args.device if device_type == "cuda" else "cpu",
        "toy": args.toy,
        "trials": n,
        "steps": steps,
        "seed": args.seed,
        "workloads": [dataclasses.asdict(w) for w in workloads(args.toy)],
        "capacity_bytes": {},
        "high_factor": args.high_factor,
        "workload_weight": {w.name: 1.0 for w in workloads(args.toy)},
        "rows": [],
        "group_end": {},
    }
    tmp = Path(tempfile.mkdtemp(prefix="gpubench-"))
    plan_path = tmp / "plan.json"
    plan_path.write_text(json.dumps(plan))
    # 1. anchors: the device's own figures and the solo peaks that size the high demand, first
    # thing in the torch group's process (or alone when that group does not run).
    anchors: dict[str, Any] = {}
    anchors_path = tmp / "anchors.json"
    plan["anchors_path"] = str(anchors_path)
    if "torch" not in args.groups:
        print(f"anchors on {plan['device']} ...", flush=True)
        plan_path.write_text(json.dumps(plan))
        why = _child(
            ["--_anchors", "--_plan", str(plan_path), "--_result", str(anchors_path)],
            {},
            min(120.0, budget_s * 0.25),
            out / "group-anchors.log",
        )
        anchors = _read_anchors(anchors_path, why, plan)
    # The pool's torch shim, compiled (once per torch) before any timed group starts.
    shim: dict[str, Any] = {"skipped": "no CUDA: the simulated device stands in for the pool"}
    if device_type == "cuda" and any(
        r.group in ("pool", "late") and r.status == "pending" for r in rows
    ):
        print("building the pool's torch shim ...", flush=True)
        shim = prebuild_shim()
        print(f"torch shim: {shim}", flush=True)
    # 2. the groups, each in a fresh process, each given a window of the remaining budget in
    # proportion to its rows' expected cost.
    run_groups = [g for g in GROUPS if any(r.group == g and r.status == "pending" for r in rows)]

    def cost(g: str) -> float:
        return (
            sum(_row_weight(r, plan) for r in rows if r.group == g and r.status == "pending")
            + (2.0 if g == "processes" else 1.0)
            + (  # the process's start-up and warm-up
                1.5 if g == "torch" and plan["anchors_path"] else 0.0
            )
        )

    by_key = {r.key: r for r in rows}
    for i, group in enumerate(run_groups):
        left = run_end - time.time()
        window = max(left * cost(group) / sum(cost(g) for g in run_groups[i:]), 1.0)
        plan["group_end"] = {group: time.time() + window - 5.0}  # leave the process time to end
        plan["rows"] = [dataclasses.asdict(r) for r in rows]
        plan_path.write_text(json.dumps(plan))
        result = tmp / f"{group}.jsonl"
        env = GROUP_ENV.get(group, {})
        print(f"group {group}: window {window:.0f} s ...", flush=True)
        why = _child(
            ["--_group", group, "--_plan", str(plan_path), "--_result", str(result)],
            env,
            window + 10.0,
            out / f"group-{group}.log",
        )
        if group == "torch":
            anchors = _read_anchors(anchors_path, why, plan)
        lines = result.read_text().splitlines() if result.exists() else []
        for line in lines:
            obj = json.loads(line)
            if "warm_up_error" in obj:
                print(f"group {group}: warm-up failed: {obj['warm_up_error']}", flush=True)
                continue
            by_key[obj["key"]] = Row(**obj)
        for r in rows:
            mine = by_key[r.key]
            if r.group == group and mine.status == "pending":
                mine.status = "error"
                mine.note = why or "the group process ended before this row"
    rows = [by_key[r.key] for r in rows]
    for r in rows:  # every method of a workload capped alike at high demand, run or not
        r.cap_bytes = plan["capacity_bytes"].get(r.workload) if r.setting == "high" else None
    # 3. ratios to temporal, the table, the files.
    for r in rows:
        base_row = by_key.get(f"{r.workload}/{r.setting}/temporal")
        if (
            base_row is not None
            and base_row.steps_per_s
            and r.steps_per_s is not None
            and r.status in ("ok", "cut")
        ):
            r.x_temporal = r.steps_per_s / base_row.steps_per_s
    label = anchors.get("device_name") or plan["device"]
    table = format_table(rows, n, anchors, f"{label} ({plan['device']})")
    print()
    print(table)
    elapsed = time.time() - t_start
    print(f"\n{len(rows)} rows in {elapsed:.0f} s (budget {budget_s:.0f} s); results in {out}")
    (out / "table.md").write_text(table + "\n")
    results = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "versions": _versions(),
        "anchors": anchors,
        "capacity_bytes": plan["capacity_bytes"],
        "torch_shim": shim,
        "trials": n,
        "steps": steps,
        "ks": ks,
        "elapsed_s": elapsed,
        "budget_s": budget_s,
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    nested = ("pool", "driver")
    fields = [f.name for f in dataclasses.fields(Row) if f.name not in nested] + list(nested)
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            d = dataclasses.asdict(r)
            for name in nested:
                d[name] = json.dumps(d[name]) if d[name] else ""
            writer.writerow(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
