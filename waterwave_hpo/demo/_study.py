"""The demo study's sampler and pruner: what every run of the demo's search uses."""

from __future__ import annotations

import optuna


def demo_sampler(seed: int, *, constant_liar: bool = True) -> optuna.samplers.TPESampler:
    """The demo's sampler: Optuna's TPE, seeded.

    Args:
        seed: Seeds the sampler. With trials running at once its proposals also depend on
            which neighbours have finished (and Optuna reseeds a sampler shared by ``n_jobs``
            threads), so only a search of one trial at a time repeats exactly.
        constant_liar: Treat running trials as bad results when proposing the next one, so
            that concurrent trials spread out (Optuna's ``constant_liar``); it changes nothing
            while one trial runs at a time.
    """
    return optuna.samplers.TPESampler(seed=seed, constant_liar=constant_liar)


def demo_pruner() -> optuna.pruners.MedianPruner:
    """The demo's pruner: stop a trial whose accuracy is below the median of earlier trials.

    Pruning starts once 4 trials have finished, from each trial's second epoch on.
    """
    return optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1)
