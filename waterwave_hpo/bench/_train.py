"""One trial's training, the same code under every method, timed per step.

Per step it measures the host time (from the step's start until Python has issued the step's
last operation; on CUDA operations are asynchronous, so this is the dispatch time, which the
co-hosted trials of one process spend under the GIL) and, on CUDA, the device time (CUDA
events around the step on the trial's stream). On the CPU operations run synchronously in the
calling thread, so host time is the whole step and device time is not separable.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
import statistics
import time
from typing import Any

import torch

from waterwave_hpo.bench._workloads import WorkloadSpec
from waterwave_hpo.bench._workloads import build
from waterwave_hpo.bench._workloads import loss_of
from waterwave_hpo.bench._workloads import make_batches


@dataclass
class TrialRecord:
    """One attempt of one trial, as measured.

    Attributes:
        index: The parameter set's index (the same trial under every method).
        attempt: 0, or k for the k-th re-run (waterwave's ``on_oom="retry"``).
        start_s: Wall-clock start, seconds since the epoch (comparable across processes).
        end_s: Wall-clock end, seconds since the epoch.
        complete: Whether it finished training.
        oom: Whether it failed for lack of device memory (or was evicted by the scheduler).
        error: The exception's text, for a failed attempt.
        samples: Samples trained (steps x batch size) if complete, else 0.
        host_s_per_step: Median host (dispatch) seconds per step.
        device_s_per_step: Median device seconds per step (CUDA events); ``None`` on the CPU.
        peak_bytes: The trial's own peak device bytes where measurable per trial (its pool
            account on CUDA with the pool; its ledger holdings on the CPU with gates), else
            ``None``.
        memory: ``(wall seconds, bytes)`` after each step, from the same source.
        slot: The worker (thread, process or executor slot) that ran it.
        planned: Whether it ran with a memory plan (``waterwave-plans``).
    """

    index: int
    attempt: int = 0
    start_s: float = 0.0
    end_s: float = 0.0
    complete: bool = False
    oom: bool = False
    error: str = ""
    samples: int = 0
    host_s_per_step: float | None = None
    device_s_per_step: float | None = None
    peak_bytes: int | None = None
    memory: list[tuple[float, int]] = field(default_factory=list)
    slot: int = 0
    planned: bool = False


def _trial_bytes(*, peak: bool = False) -> int | None:
    """Bytes the running trial holds now.

    Bytes the running trial holds now (``peak``: the most it has held since it started):
    its pool account on CUDA, its ledger holdings on the CPU; ``None`` outside the executor.

    The account is the trial's own (opened when it started); a slot's stream is reused by the
    slot's later trials, so the stream's counters would give the slot's running maximum.
    """
    from waterwave_hpo.executor import current_or_none
    from waterwave_hpo.executor import trial_memory_stats

    ctx = current_or_none()
    if ctx is None:
        return None
    stats = trial_memory_stats()
    if stats is not None:
        return int(stats.peak_allocated_bytes if peak else stats.allocated_bytes)
    if ctx.scheduler is None:
        return None
    if not peak:
        return int(ctx.scheduler.held_bytes(ctx.trial_number))
    for t in ctx.scheduler.stats().trials:
        if t.trial_number == ctx.trial_number:
            return int(t.peak_held_bytes)
    return None


def train(
    spec: WorkloadSpec,
    params: dict[str, Any],
    record: TrialRecord,
    device: torch.device,
    *,
    seed: int,
    gated: bool = False,
    planned: bool = False,
    stream: Any = None,
) -> float:
    """Train one trial and fill its record.

    Train the trial ``record.index`` with ``params`` for ``spec.steps`` steps; fill
    ``record``; return the last loss.

    Args:
        spec: Workload, batch size, steps.
        params: The trial's parameters (from :func:`draw_params`).
        record: Filled in place (start, end, samples, step times, memory).
        device: Where to train.
        seed: Base seed; the model and data are seeded from it and ``record.index``.
        gated: Wrap the model with :func:`waterwave_hpo.pipeline` (NodeGroup gates; they pass
            through outside the executor).
        planned: Register the model with :func:`waterwave_hpo.fit_trial_memory` (a memory
            plan when it does not fit beside its neighbours; a pass-through outside the
            executor). Not with ``gated``.
        stream: The CUDA stream to time on (``None``: the current stream).

    Raises:
        Exception: Whatever training raises (out-of-memory errors included), after ``record``
            has its end time and error.
    """
    record.start_s = time.time()
    try:
        torch.manual_seed(seed * 1_000_003 + record.index)
        model = build(spec.workload, params).to(device)
        if gated:
            from waterwave_hpo.nodegroup import pipeline

            model = pipeline(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=float(params["lr"]))
        batches = make_batches(spec, device, seed * 7919 + record.index)
        if planned:
            from waterwave_hpo.executor import current_or_none
            from waterwave_hpo.executor import fit_trial_memory

            # No optimizer: the plan's budget then counts what the gates' ledger counts
            # (parameters, gradients, saved activations), so the methods' ledgers compare.
            model = fit_trial_memory(model, example_input=batches[0][0])
            ctx = current_or_none()
            record.planned = bool(ctx and ctx.planning and ctx.planning.plan is not None)
        cuda = device.type == "cuda"
        if cuda:
            stream = stream if stream is not None else torch.cuda.current_stream(device)
        events: list[tuple[Any, Any]] = []
        host: list[float] = []
        loss = torch.zeros(())
        for step in range(spec.steps):
            x, y = batches[step % len(batches)]
            t0 = time.perf_counter()
            if cuda:
                begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                begin.record(stream)  # type: ignore[no-untyped-call,unused-ignore]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(spec, model(x), y)
            held = _trial_bytes()  # the forward peak: activations saved for backward
            if held is not None:
                record.memory.append((time.time(), held))
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            if cuda:
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end.record(stream)  # type: ignore[no-untyped-call,unused-ignore]
                events.append((begin, end))
            host.append(time.perf_counter() - t0)
            held = _trial_bytes()
            if held is not None:
                record.memory.append((time.time(), held))
        value = float(loss.detach().item())
        if cuda:  # this trial's stream only: a device-wide wait would wait for the neighbours
            stream.synchronize()
            record.device_s_per_step = statistics.median(b.elapsed_time(e) / 1e3 for b, e in events)
        record.host_s_per_step = statistics.median(host) if host else None
        peak = _trial_bytes(peak=True)
        if peak is not None:
            record.peak_bytes = peak
        elif record.memory:
            record.peak_bytes = max(b for _, b in record.memory)
        record.samples = spec.steps * spec.batch_size
        record.complete = True
        return value
    except BaseException as error:
        from waterwave_hpo.executor import is_out_of_memory

        record.oom = isinstance(error, Exception) and is_out_of_memory(error)
        record.error = f"{type(error).__name__}: {error}"[:300]
        raise
    finally:
        record.end_s = time.time()


def train_fused(
    spec: WorkloadSpec,
    params: list[dict[str, Any]],
    records: list[TrialRecord],
    device: torch.device,
    *,
    seed: int,
) -> list[float]:
    """Train trials of one structure as one fused model; fill each trial's record.

    Horizontal fusion (HFTA, arXiv:2102.02344; :func:`waterwave_hpo.fusion.fuse`): the K
    models are built and seeded exactly as :func:`train` builds each one, stacked into one
    module, and trained by a fused AdamW with each model's own learning rate; model ``k`` trains
    on its own batches (``[K, B, ...]``, from the same per-trial seed as :func:`train`). The
    records share the fused steps' times: start, end and host seconds per step are the array's.

    Args:
        spec: Workload, batch size, steps.
        params: The K trials' parameters; their models must have one structure
            (:func:`waterwave_hpo.fusion.structure_key`).
        records: One per trial, in the order of ``params``; filled in place.
        device: Where to train.
        seed: Base seed, as for :func:`train`.

    Returns:
        Each model's last loss.

    Raises:
        Exception: Whatever fusing or training raises, after every record has its end time and
            error.
    """
    from waterwave_hpo import fusion

    start_s = time.time()
    for record in records:
        record.start_s = start_s
    try:
        models = []
        for record, p in zip(records, params, strict=True):
            torch.manual_seed(seed * 1_000_003 + record.index)
            models.append(build(spec.workload, p))
        fused = fusion.fuse(models).to(device)
        optimizer = fusion.optimizer(
            torch.optim.AdamW, fused, [{"lr": float(p["lr"])} for p in params]
        )
        per_trial = [make_batches(spec, device, seed * 7919 + r.index) for r in records]
        stacked = [
            (
                torch.stack([batches[i][0] for batches in per_trial]),
                torch.stack([batches[i][1] for batches in per_trial]),
            )
            for i in range(len(per_trial[0]))
        ]
        host: list[float] = []
        losses = torch.zeros(len(records))
        for step in range(spec.steps):
            xs, ys = stacked[step % len(stacked)]
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            losses = fusion.per_model_loss(
                lambda out, y: loss_of(spec, out, y),
                fused(xs, stacked=True),
                ys,
                target_stacked=True,
            )
            losses.sum().backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            host.append(time.perf_counter() - t0)
        values = [float(v) for v in losses.detach().tolist()]
        for record in records:
            record.host_s_per_step = statistics.median(host) if host else None
            record.samples = spec.steps * spec.batch_size
            record.complete = True
        return values
    except BaseException as error:
        from waterwave_hpo.executor import is_out_of_memory

        for record in records:
            record.oom = isinstance(error, Exception) and is_out_of_memory(error)
            record.error = f"{type(error).__name__}: {error}"[:300]
        raise
    finally:
        end_s = time.time()
        for record in records:
            record.end_s = end_s
