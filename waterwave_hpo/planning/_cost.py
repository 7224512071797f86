"""The cost model: a plan's step time and peak device bytes, from a step's profile.

Pure functions over :class:`StepProfile` (no torch), called thousands of times by the planners.

The timeline (one forward, then one backward; our reading of HOME's cost model, He et al.,
IEEE Trans. Computers 2022, Sec. 4, made concrete for our placement units):

- Compute runs on one stream: unit ``0..n-1`` forwards, then unit ``n-1..0`` backwards. A
  recompute unit's backward first runs its forward again (``forward_s + backward_s``).
- Copies run on one copy stream, in the order they are issued, at ``bandwidth_bytes_per_s``
  (host<->device, measured on CUDA by the bench; a parameter on the CPU). A swap unit's
  swap-out is issued when its forward ends; its prefetch is issued when the backward of the
  unit after it begins (the last unit's at the start of backward). A unit's backward waits for
  its prefetch: that wait is the transfer time not hidden behind compute.
- Device bytes: ``static_bytes`` (parameters, gradients, optimizer state) and
  ``other_saved_bytes`` for the whole step; a keep unit's ``saved_bytes`` from its forward to
  the end of its backward; a recompute unit's ``input_bytes`` likewise, plus its
  ``saved_bytes`` during its backward (the recompute's transient); a swap unit's
  ``saved_bytes`` until its swap-out completes and again from its prefetch to the end of its
  backward. The peak is taken at every unit's forward end and backward start, where the
  counted bytes are largest.

Assumptions (each errs towards a larger peak): storages shared by two units count in both;
gradients count from the step's start; the activation a unit is computing and the gradients
flowing between units are not counted (neither does the ledger that checks plans).
"""

from __future__ import annotations

from collections.abc import Sequence

from waterwave_hpo.planning._plan import Placement
from waterwave_hpo.planning._plan import Prediction
from waterwave_hpo.planning._plan import StepProfile

#: Host<->device bandwidth used when none is given: 12 GB/s, a PCIe 3.0 x16 link's practical
#: rate. On the CPU there is no link; swap time there is this model's, not a measurement.
DEFAULT_BANDWIDTH_BYTES_PER_S = 12e9


def predict(
    profile: StepProfile,
    choices: Sequence[Placement],
    bandwidth_bytes_per_s: float = DEFAULT_BANDWIDTH_BYTES_PER_S,
) -> Prediction:
    """Predict one training step's seconds and peak device bytes under a plan.

    Args:
        profile: The step's profile (``n`` units).
        choices: One placement per unit, in forward order (length ``n``).
        bandwidth_bytes_per_s: Host<->device copy rate in bytes per second (``> 0``).

    Returns:
        The predicted step seconds and peak bytes.

    Raises:
        ValueError: If ``len(choices) != n`` or the bandwidth is not positive.
    """
    units = profile.units
    n = len(units)
    if len(choices) != n:
        raise ValueError(f"choices has {len(choices)} entries but the profile has {n} units.")
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(
            f"bandwidth_bytes_per_s is {bandwidth_bytes_per_s!r} but must be > 0 (bytes/s)."
        )
    base = profile.static_bytes + profile.other_saved_bytes
    held = [0] * n  # device bytes a unit holds from its forward to its backward (not swaps)
    swap_out_end = [0.0] * n
    swap_bytes = [0] * n
    t = 0.0
    copy_free = 0.0
    peak = base
    held_sum = 0
    for i, u in enumerate(units):
        c = choices[i]
        t += u.forward_s
        if c is Placement.KEEP:
            held[i] = u.saved_bytes
        elif c is Placement.RECOMPUTE:
            held[i] = u.input_bytes
        else:
            swap_bytes[i] = u.saved_bytes
            start = max(t, copy_free)
            copy_free = start + u.saved_bytes / bandwidth_bytes_per_s
            swap_out_end[i] = copy_free
        held_sum += held[i]
        pending = sum(swap_bytes[j] for j in range(i + 1) if swap_out_end[j] > t)
        peak = max(peak, base + held_sum + pending)

    prefetch_done: dict[int, float] = {}

    def issue(j: int, at: float) -> None:
        nonlocal copy_free
        if j < 0 or choices[j] is not Placement.SWAP or j in prefetch_done:
            return
        start = max(at, copy_free)
        copy_free = start + swap_bytes[j] / bandwidth_bytes_per_s
        prefetch_done[j] = copy_free

    for k in range(n - 1, -1, -1):
        issue(k, t)
        issue(k - 1, t)
        start = max(t, prefetch_done.get(k, 0.0))
        swapped_in = sum(
            swap_bytes[j]
            for j in range(k + 1)
            if swap_bytes[j] and (j in prefetch_done or swap_out_end[j] > start)
        )
        transient = units[k].saved_bytes if choices[k] is Placement.RECOMPUTE else 0
        peak = max(peak, base + held_sum + swapped_in + transient)
        t = start + units[k].backward_s
        if choices[k] is Placement.RECOMPUTE:
            t += units[k].forward_s
        held_sum -= held[k]
    return Prediction(step_s=t, peak_bytes=peak)


def floor_bytes(profile: StepProfile) -> int:
    """The least peak any plan can reach: every unit at its smallest device footprint.

    Returns:
        ``static_bytes + other_saved_bytes`` plus, per unit, nothing (swap), which the
        transfer windows raise; a lower bound, in bytes, not a plan's peak.
    """
    return profile.static_bytes + profile.other_saved_bytes
