"""A sampler that counts the reseeds of its RNG, for the executors' reseeding rules.

``Study.optimize`` reseeds the sampler before each trial when ``n_jobs != 1``; the executors
reseed the sampler of the process that samples, and only as often as that process needs.
"""

from __future__ import annotations

import optuna


class ReseedCountingSampler(optuna.samplers.RandomSampler):
    """A seeded ``RandomSampler`` whose :attr:`reseeds` counts ``reseed_rng`` calls on this
    instance: in the process it lives in (a pickled copy counts its own)."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.reseeds = 0

    def reseed_rng(self) -> None:
        self.reseeds += 1
        super().reseed_rng()
