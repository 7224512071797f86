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
- Recompute runs: consecutive recompute units that chain and save little more than their
  inputs (:func:`recompute_runs`) are one checkpoint: the run keeps only its first unit's
  ``input_bytes``, and the backward of its last unit recomputes the whole run (all its
  forwards), whose activations are then freed unit by unit as backward proceeds.
- Device bytes: ``static_bytes`` (parameters, gradients, optimizer state) and
  ``other_saved_bytes`` for the whole step; a keep unit's ``saved_bytes`` from its forward to
  the end of its backward; a recompute run's first ``input_bytes`` likewise, and every
  recompute unit's ``random_bytes`` (its random ops' results, replayed), plus the
  run's recomputed ``saved_bytes`` (of the units whose backward has not ended) during its
  backward (the recompute's transient); a swap unit's
  ``saved_bytes`` until its swap-out completes and again from its prefetch to the end of its
  backward. The peak is taken at every unit's forward end and backward start, where the
  counted bytes are largest.

Assumptions (each errs towards a larger peak): storages shared by two units count in both;
gradients count from the step's start; the activation a unit is computing and the gradients
flowing between units are not counted (neither does the ledger that checks plans).
"""

from __future__ import annotations

from collections.abc import Sequence

from waterwave_hpo import _checks
from waterwave_hpo.planning._plan import Placement
from waterwave_hpo.planning._plan import Prediction
from waterwave_hpo.planning._plan import StepProfile

#: Host<->device bandwidth used when none is given: 12 GB/s, a PCIe 3.0 x16 link's practical
#: rate. On the CPU there is no link; swap time there is this model's, not a measurement.
DEFAULT_BANDWIDTH_BYTES_PER_S = 12e9


#: A chained recompute unit saving at most this many times its input joins the run before it.
JOIN_SAVED_PER_INPUT = 2.0


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
        raise _checks.value_error(
            "bandwidth_bytes_per_s",
            bandwidth_bytes_per_s,
            "must be > 0",
            "pass the copy bandwidth in bytes/s",
        )
    base = profile.static_bytes + profile.other_saved_bytes
    run_start = recompute_runs(profile, choices)
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
            held[i] = (u.input_bytes if run_start[i] == i else 0) + u.random_bytes
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
        transient = 0
        t = start + units[k].backward_s
        if choices[k] is Placement.RECOMPUTE:
            first = run_start[k]
            transient = sum(units[m].saved_bytes for m in range(first, k + 1))
            if k == n - 1 or run_start[k + 1] != first:  # the run's last unit: recompute it all
                t += sum(units[m].forward_s for m in range(first, k + 1))
        peak = max(peak, base + held_sum + swapped_in + transient)
        held_sum -= held[k]
    return Prediction(step_s=t, peak_bytes=peak)


def recompute_runs(profile: StepProfile, choices: Sequence[Placement]) -> list[int]:
    """Per unit, the first unit of its recompute run (itself unless it is a chained recompute).

    A recompute unit joins the run of the recompute unit before it when it chains
    (``Unit.chains_previous``) and recomputing it alone would free little: it saves at most
    ``JOIN_SAVED_PER_INPUT`` times its input (a layer of a plain chain), while a unit that
    saves much more than its input (a residual or transformer block) is its own checkpoint,
    which bounds the run's recompute transient (ours; Chen et al. 2016 join whole segments).

    Returns:
        ``run_start[i]``: ``i`` for a keep or swap unit or a run's first unit; otherwise the
        first unit of the chained recompute run ``i`` belongs to.
    """
    starts = list(range(len(choices)))
    for i in range(1, len(choices)):
        u = profile.units[i]
        if (
            choices[i] is Placement.RECOMPUTE
            and choices[i - 1] is Placement.RECOMPUTE
            and u.chains_previous
            and u.saved_bytes <= JOIN_SAVED_PER_INPUT * u.input_bytes
        ):
            starts[i] = starts[i - 1]
    return starts
