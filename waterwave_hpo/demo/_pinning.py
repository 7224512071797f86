"""A sampler that gives the trials of one fused batch one structure: its first trial's."""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
import threading
from typing import TYPE_CHECKING
from typing import Any

from optuna.samplers import BaseSampler

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution
    from optuna.study import Study
    from optuna.trial import FrozenTrial
    from optuna.trial import TrialState


class StructurePinningSampler(BaseSampler):
    """A sampler whose trials, once told to follow another, take its structure.

    A fused batch trains its K models as one (HFTA: Wang et al., MLSys 2021,
    arXiv:2102.02344), so they must share every parameter that shapes the model or the training
    step; only per-model numbers may differ. The batch's first trial samples the whole space
    through ``base``. Before each other trial of the batch suggests anything, its objective
    calls :meth:`follow` with the first trial's parameters: that trial then takes those values
    for every parameter not in ``free`` (recorded as its own, with their distributions, so
    ``base`` learns from all K trials) and samples the ``free`` ones through ``base``, its
    relative search space cut to them (as Optuna's ``PartialFixedSampler`` does for a whole
    study).

    Call :meth:`follow` before the trial's first ``suggest_*``: Optuna samples a trial's
    relative parameters at its first suggestion.

    Args:
        base: The sampler every sampled value comes from (e.g. the demo's TPE).
        free: The parameters a following trial samples itself (the demo's NAS search:
            ``lr`` and ``dropout``).
    """

    def __init__(self, base: BaseSampler, free: Iterable[str]) -> None:
        self.base = base
        self.free = frozenset(free)
        self._lock = threading.Lock()
        self._pinned: dict[int, dict[str, Any]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def follow(self, trial_number: int, params: Mapping[str, Any]) -> None:
        """Make trial ``trial_number`` take ``params``' values, but for the free parameters.

        Args:
            trial_number: The following trial's number (``trial.number``).
            params: The parameters it follows (the batch's first trial's ``trial.params``).
        """
        pinned = {name: value for name, value in params.items() if name not in self.free}
        with self._lock:
            self._pinned[trial_number] = pinned

    def pinned(self, trial_number: int) -> dict[str, Any]:
        """The values trial ``trial_number`` takes (empty: it samples every parameter)."""
        with self._lock:
            return dict(self._pinned.get(trial_number, {}))

    def reseed_rng(self) -> None:
        """Reseed ``base``."""
        self.base.reseed_rng()

    def infer_relative_search_space(
        self, study: Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        """``base``'s relative search space, without the parameters this trial takes."""
        space = self.base.infer_relative_search_space(study, trial)
        pinned = self.pinned(trial.number)
        return {name: d for name, d in space.items() if name not in pinned}

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        """``base``'s relative sample of ``search_space``."""
        return self.base.sample_relative(study, trial, search_space)

    def sample_independent(
        self,
        study: Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        """The value this trial takes for ``param_name``, else ``base``'s sample."""
        pinned = self.pinned(trial.number)
        if param_name not in pinned:
            return self.base.sample_independent(study, trial, param_name, param_distribution)
        return pinned[param_name]

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        """``base``'s ``before_trial``."""
        self.base.before_trial(study, trial)

    def after_trial(
        self,
        study: Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        """``base``'s ``after_trial``; the trial's pinned values are forgotten."""
        with self._lock:
            self._pinned.pop(trial.number, None)
        self.base.after_trial(study, trial, state, values)
