"""The data of memory planning: placements, placement units, a step's profile, a plan.

Pure data (no torch), shared by the cost model, the planners and the code that applies a plan.
The three placements are HOME's (He et al., "HOME: A Holistic GPU Memory Management Framework
for Deep Learning", IEEE Trans. Computers 2022, Sec. 3): keep a saved activation on the device,
swap it to host memory and back before backward needs it, or recompute it in backward.
"""

from __future__ import annotations

from dataclasses import dataclass
import enum


class Placement(str, enum.Enum):
    """Where a placement unit's saved activations live between its forward and its backward."""

    KEEP = "keep"
    """On the device (what PyTorch does)."""
    SWAP = "swap"
    """Copied to host memory after forward, copied back (prefetched) before backward."""
    RECOMPUTE = "recompute"
    """Dropped after forward; the unit's forward runs again in backward (checkpointing)."""


@dataclass(frozen=True)
class Unit:
    """One placement unit: an atom of the NodeGroup profiler (a piece between valid cuts).

    HOME plans per tensor; we plan per atom, the pieces across which one tensor is all that
    crosses, so a plan is always applicable with ``torch.utils.checkpoint`` and
    ``saved_tensors_hooks`` (our reduction of HOME's search space).

    Attributes:
        name: The qualified names of the unit's outermost modules, joined by ``"+"``.
        saved_bytes: Bytes its modules save for backward (distinct storages within the unit,
            parameters excluded).
        input_bytes: Bytes of the tensor arguments of its outermost module calls: what a
            recompute keeps on the device (the checkpoint's inputs).
        forward_s: Forward seconds of the profiled step.
        backward_s: Backward seconds of the profiled step.
        chains_previous: Whether this unit's modules directly follow the previous unit's in
            one ``nn.Sequential``, so a run of recompute units is one checkpoint that keeps
            only the run's first input (Chen et al. 2016's segments; ours: found per model).
        random_bytes: Bytes of the results of the random ops its forward runs (dropout's
            mask or noise...): what a recompute keeps from forward to backward besides its
            input, so that the recompute replays the forward's random numbers instead of
            drawing from the process's generator again (see ``planning/_rng.py``).
    """

    name: str
    saved_bytes: int
    input_bytes: int
    forward_s: float
    backward_s: float
    chains_previous: bool = False
    random_bytes: int = 0


@dataclass(frozen=True)
class StepProfile:
    """What the cost model knows about one training step of a model.

    Attributes:
        units: The placement units in forward order.
        static_bytes: Parameters + gradients + optimizer state, in bytes: resident for the
            whole step and the floor no plan goes below.
        other_saved_bytes: Saved-for-backward bytes of work outside every unit's modules
            (functional ops in a parent's ``forward``); always kept.
    """

    units: tuple[Unit, ...]
    static_bytes: int
    other_saved_bytes: int = 0


@dataclass(frozen=True)
class Prediction:
    """The cost model's verdict on one plan.

    Attributes:
        step_s: Predicted seconds of one forward + backward.
        peak_bytes: Predicted peak device bytes over the step (static + saved activations).
    """

    step_s: float
    peak_bytes: int


@dataclass(frozen=True)
class MemoryPlan:
    """The plan installed on a model by :func:`~waterwave_hpo.fit_memory`.

    Attributes:
        choices: Unit name -> ``"keep"`` | ``"swap"`` | ``"recompute"``, in forward order.
        predicted_peak_bytes: The cost model's peak device bytes of one step with the plan.
        predicted_step_seconds: The cost model's seconds of one step with the plan.
        planner: The planner's name (``"none"``, ``"swap_all"``, ``"checkpoint_sqrt"``,
            ``"capuchin"``, ``"exhaustive"``, ``"pso"``).
        budget_bytes: The budget the plan was made for.
        search_s: Wall seconds the planner took.
    """

    choices: dict[str, str]
    predicted_peak_bytes: int
    predicted_step_seconds: float
    planner: str
    budget_bytes: int
    search_s: float = 0.0
