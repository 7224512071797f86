"""Batch sizes, capacity, steps: scale each workload to the device and the time budget."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import replace
from typing import Any

import torch

from waterwave_hpo.bench._train import TrialRecord
from waterwave_hpo.bench._train import train
from waterwave_hpo.bench._workloads import Workload
from waterwave_hpo.bench._workloads import WorkloadSpec
from waterwave_hpo.bench._workloads import build
from waterwave_hpo.bench._workloads import make_batches
from waterwave_hpo.scheduler import TrialProfile
from waterwave_hpo.sim import SimPlan

#: Batch sizes of the light setting before fitting them to the device (samples per step).
BASE_BATCH = {
    "cpu": {Workload.RESNET: 16, Workload.GPT: 8, Workload.DIGITS: 64},
    "cuda": {Workload.RESNET: 128, Workload.GPT: 32, Workload.DIGITS: 256},
}
#: Tokens per GPT sequence.
SEQ_LEN = {"cpu": 32, "cuda": 256}
#: The most samples per step the high setting may use (digits' 8x8 images would need millions
#: to fill a GPU; the results then say the high demand was not reached).
MAX_BATCH = 65536


def profile_trial(spec: WorkloadSpec, params: dict[str, Any], seed: int = 0) -> TrialProfile:
    """The trial's NodeGroup profile (bytes) at ``spec.batch_size``, measured on the CPU.

    The trial's NodeGroup profile (bytes) at ``spec.batch_size``, measured on the CPU with
    :func:`waterwave_hpo.pipeline` on one example batch (saved-tensor sizes do not depend on
    the device for these models).
    """
    from waterwave_hpo.nodegroup import pipeline
    from waterwave_hpo.nodegroup import trial_profile

    torch.manual_seed(seed)
    model = build(spec.workload, params)
    x, _ = make_batches(spec, torch.device("cpu"), seed, n_batches=1)[0]
    pipeline(model, example_input=x)
    return trial_profile(model)


@dataclass(frozen=True)
class PlanProfile:
    """A trial's step as the executor's memory planning sees it (bytes, a ratio).

    Measured with the planning package's profiler and cost model, without optimizer state
    (the bytes the NodeGroup gates' ledger counts, so the methods compare).

    Attributes:
        static_bytes: Parameters + gradients.
        plain_activation_bytes: The plain step's predicted peak less ``static_bytes``.
        smallest_activation_bytes: The smallest plan's predicted peak less ``static_bytes``.
        slowdown: The smallest plan's predicted step seconds over the plain step's.
    """

    static_bytes: int
    plain_activation_bytes: int
    smallest_activation_bytes: int
    slowdown: float

    @property
    def plain_peak_bytes(self) -> int:
        """The plain step's peak, bytes."""
        return self.static_bytes + self.plain_activation_bytes

    def scaled(self, factor: float) -> PlanProfile:
        """The same trial at ``factor`` times the batch (activations are linear in it)."""
        return PlanProfile(
            self.static_bytes,
            int(self.plain_activation_bytes * factor),
            int(self.smallest_activation_bytes * factor),
            self.slowdown,
        )

    def sim_plan(self) -> SimPlan:
        """What a plan can do for the trial, for the simulator."""
        return SimPlan(self.static_bytes + self.smallest_activation_bytes, self.slowdown)


def plan_profile(spec: WorkloadSpec, params: dict[str, Any], seed: int = 0) -> PlanProfile:
    """The trial's :class:`PlanProfile` at ``spec.batch_size``, measured on the CPU."""
    from waterwave_hpo.planning import DEFAULT_BANDWIDTH_BYTES_PER_S
    from waterwave_hpo.planning._internal import plan_none
    from waterwave_hpo.planning._internal import plan_smallest
    from waterwave_hpo.planning._internal import profile_units

    torch.manual_seed(seed)
    model = build(spec.workload, params)
    x, _ = make_batches(spec, torch.device("cpu"), seed, n_batches=1)[0]
    profile, _ = profile_units(model, x)
    bw = DEFAULT_BANDWIDTH_BYTES_PER_S
    plain = plan_none(profile, 0, bandwidth_bytes_per_s=bw).prediction
    smallest = plan_smallest(profile, bandwidth_bytes_per_s=bw).prediction
    return PlanProfile(
        profile.static_bytes,
        plain.peak_bytes - profile.static_bytes,
        smallest.peak_bytes - profile.static_bytes,
        max(1.0, smallest.step_s / max(plain.step_s, 1e-12)),
    )


def fit_batches(
    light: WorkloadSpec,
    params: list[dict[str, Any]],
    k: int,
    capacity_bytes: int | None,
) -> tuple[WorkloadSpec, WorkloadSpec, int, list[TrialProfile], list[TrialProfile]]:
    """The light and high settings of a workload, and the capacity they are measured against.

    With a capacity (CUDA): light is the base batch, halved until the ``k`` largest solo peaks
    fit in 80% of the capacity; high (the paper's high memory demand) is the batch at which the
    largest solo peak is ``min(70%, 200%/k)`` of the capacity, so ``k`` co-hosted trials' solo
    peaks add up to more than the device memory while each fits alone (at most
    ``MAX_BATCH``; the results say whether the demand was reached). Without one (CPU): light is
    the base batch, high a power-of-two multiple of it, and the capacity is chosen so that the
    light trials fit together and each high trial fits alone but ``k`` of them do not. Peaks are
    linear in the batch size (resident bytes plus activations per sample), from one profile at
    the base batch.

    Args:
        light: The light spec at the base batch.
        params: The trials' parameters.
        k: Trials at once.
        capacity_bytes: The device memory, in bytes; ``None`` on the CPU: derived as 1.25x the
            sum of the ``k`` largest light peaks (a virtual capacity, enforced only by the
            waterwave scheduler's ledger).

    Returns:
        ``(light, high, capacity_bytes, light_profiles, high_profiles)``.
    """
    base = [profile_trial(light, p) for p in params]
    resident = [p.resident_bytes for p in base]
    per_sample = [p.activation_bytes / light.batch_size for p in base]

    def peaks(batch: int) -> list[float]:
        return sorted(
            (r + a * batch for r, a in zip(resident, per_sample, strict=True)), reverse=True
        )

    if capacity_bytes is None:
        # A virtual capacity (CPU): the light trials fit together with room to spare, and a
        # high batch 2^j times the light one makes each trial fit alone but not k together.
        factor = 2
        while True:
            high_batch = light.batch_size * factor
            cap = int(max(1.25 * sum(peaks(light.batch_size)[:k]), 1.25 * peaks(high_batch)[0]))
            if sum(peaks(high_batch)[:k]) > cap or factor >= 1024:
                break
            factor *= 2
        capacity_bytes = cap
    else:
        batch = light.batch_size
        while batch > 1 and sum(peaks(batch)[:k]) > 0.8 * capacity_bytes:
            batch //= 2
        light = replace(light, batch_size=batch)
        # The largest trial's solo peak at min(70%, 200%/k) of the capacity: each fits alone,
        # k of them do not fit together.
        target = min(0.7, 2.0 / k) * capacity_bytes
        worst = max(range(len(base)), key=lambda i: resident[i] + per_sample[i] * batch)
        slope = max(per_sample[worst], 1e-9)
        high_batch = int((target - resident[worst]) / slope)
        high_batch = max(light.batch_size + 1, min(MAX_BATCH, high_batch))
    high = replace(light, setting=type(light.setting).HIGH, batch_size=high_batch)
    light_profiles = [profile_trial(light, p) for p in params]
    high_profiles = [_scaled(p, high_batch / light.batch_size) for p in light_profiles]
    return light, high, capacity_bytes, light_profiles, high_profiles


def _scaled(profile: TrialProfile, factor: float) -> TrialProfile:
    return TrialProfile.of(profile.resident_bytes, [int(b * factor) for b in profile.group_bytes])


def step_seconds(spec: WorkloadSpec, params: dict[str, Any], device: torch.device) -> float:
    """Seconds of one solo training step of ``params`` on ``device``.

    Seconds of one solo training step of ``params`` on ``device``, for fitting the steps to
    ``--budget-s``: the median step of a 7-step trial after a 2-step warm-up trial (the larger
    of its host and device medians, so CUDA's asynchronous launches are not mistaken for the
    step).
    """
    train(replace(spec, steps=2), params, TrialRecord(index=0), device, seed=0)
    record = TrialRecord(index=0)
    train(replace(spec, steps=7), params, record, device, seed=0)
    return max(record.host_s_per_step or 0.0, record.device_s_per_step or 0.0, 1e-5)


def warm_up(spec: WorkloadSpec, params: dict[str, Any], device: torch.device) -> None:
    """One training step of ``params`` at ``spec``'s batch, as a warm-up.

    One training step of ``params`` at ``spec``'s batch, so the first measured method does
    not pay for lazy initialization (kernel selection for the shape, thread pools, first
    allocations).
    """
    train(replace(spec, steps=1), params, TrialRecord(index=0), device, seed=0)
