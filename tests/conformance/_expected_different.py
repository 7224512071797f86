"""Optuna tests that assert Optuna's internals, so they are expected to differ under the executor.

Each entry is a pytest node id (without parameters: it covers every parametrization) of Optuna's
own tests, with why the executor legitimately differs. Any other failure is a bug in the
executor. Keep this list short and every reason specific.
"""

from __future__ import annotations

_STUDY = "tests/study_tests/test_study.py::"
_HYPERBAND = "tests/pruners_tests/test_hyperband.py::"

# Both K=1 and K=4.
_ALWAYS: dict[str, str] = {
    _STUDY + "test_optimize_with_progbar_parallel_timeout": (
        "asserts Optuna's warning that a timeout progress bar is unsupported with n_jobs != 1; "
        "the executor ignores n_jobs and shows the timeout bar"
    ),
    _STUDY + "test_optimize_trivial_rdb_resume_study": (
        "uses sqlite:///:memory:, which the executor refuses before any trial by design "
        "(a per-connection database loses trials told from the slots' threads)"
    ),
    "tests/pruners_tests/test_hyperband.py::test_hyperband_filter_study": (
        "not the executor: needs the optional cmaes package (CmaEsSampler), which Optuna's "
        "test extra does not install; it fails the same way with Optuna's own optimize"
    ),
}

# Only under isolation="process", at every K: the objective runs in a worker process, on a copy
# of what the test built; what it does to that copy stays in the worker.
_PROCESS: dict[str, str] = {
    _STUDY + name: "the objective is a Func object holding a threading.Lock (it counts its "
    "calls across Optuna's n_jobs threads), which cannot be pickled: process isolation refuses "
    "it before any trial with the fix in the message (its documented rule); its call count "
    "would stay in the test's process anyway"
    for name in (
        "test_optimize_parallel",
        "test_optimize_parallel_timeout",
        "test_optimize_with_reseeding",
    )
}
_PROCESS.update(
    {
        "tests/trial_tests/test_trial.py::test_datetime_start": (
            "the objective stores trial.datetime_start in a list of the test's; in a worker it "
            "fills the worker's copy of that list, so the test's stays [None]"
        ),
        _STUDY + "test_optimize_with_gc": (
            "patches gc.collect in the test's process and counts its calls; with "
            "gc_after_trial=True each worker collects its own garbage after its trials"
        ),
        _STUDY + "test_enqueue_trial_with_out_of_range_parameters": (
            "pytest.warns in the test's process for the UserWarning suggest_int raises in "
            "the objective; in a worker the warning is shown there (on the shared stderr, "
            "under the driver's warning filters), not raised again in the driver"
        ),
    }
)

# Only with one trial at a time (K = 1).
_SEQUENTIAL: dict[str, str] = {
    _STUDY + "test_optimize_with_reseeding": (
        "asserts sampler.reseed_rng() once per trial for n_jobs=2; the executor ignores n_jobs "
        "(trials_per_device replaces it) and, like Study.optimize with n_jobs=1, reseeds only "
        "when trials run at once (K > 1, where this test passes)"
    ),
}

# Only with several trials at once (K > 1): the test counts on one trial at a time, as with
# Optuna's n_jobs=1; Optuna's own n_jobs > 1 breaks the same assumptions.
_CONCURRENT: dict[str, str] = {
    _STUDY + name: "a sampler's after_trial asserts len(study.trials) - 1 == trial.number, "
    "true only while trials run one at a time"
    for name in (
        "test_after_trial",
        "test_after_trial_failing",
        "test_after_trial_pruning",
        "test_after_trial_failing_in_after_trial",
    )
}
_CONCURRENT.update(
    {
        _STUDY + "test_optimize_with_catch": (
            "asserts one trial before an uncaught exception stops the study; K trials start at "
            "once, the running ones finish and are told (the executor's documented semantics)"
        ),
        _STUDY + "test_optimize_with_progbar": (
            "asserts 'Best trial: 0' on the bar; with concurrent trials another may be best"
        ),
        _STUDY + "test_optimize_with_progbar_timeout": (
            "asserts 'Best trial: 0' on the bar for trials of equal value; concurrent trials "
            "end in any order and the first to end is the best (seen under processes at K=4)"
        ),
        _STUDY + "test_optimize_progbar_n_trials_prioritized": (
            "asserts 'Best trial: 0' on the bar for two trials of equal value; concurrent "
            "trials end in any order and the first to end is the best (seen at K=4 under "
            "threads on the loaded VM, and under processes)"
        ),
        "tests/pruners_tests/test_hyperband.py::test_hyperband_pruner_and_brute_force_sampler": (
            "asserts BruteForceSampler's exact 9 trials; concurrent trials are sampled before "
            "the earlier ones finish, as with Optuna's n_jobs > 1"
        ),
        "tests/pruners_tests/test_hyperband.py::test_hyperband_pruner_and_grid_sampler": (
            "asserts GridSampler's exact 9 trials; a trial asked while the last grid points "
            "run samples one again, as with Optuna's n_jobs > 1"
        ),
        _HYPERBAND + "test_hyperband_no_call_of_filter_study_in_should_prune": (
            "patches optuna.pruners._filter_study (process-wide) inside the objective and asserts "
            "it is not called; with concurrent trials a neighbour's ask (relative sampling) or "
            "tell calls it under HyperbandPruner and hits this trial's mock, as with Optuna's "
            "n_jobs > 1 (seen at K=4, threads); two trials' patches that interleave can leave "
            "the mock installed (mock.patch is not thread-safe), which the plugin undoes after "
            "the test"
        ),
        _STUDY + "test_optimize_parallel_timeout": (
            "asserts at most timeout / sleep objective calls for Optuna's n_jobs; K trials run "
            "at once within the same timeout"
        ),
    }
)
_CONCURRENT.update(
    {
        name: "asserts at most n_jobs - 1 trials (Optuna: 1 or 2) beyond study.stop(); with "
        "K slots up to K - 1 running trials finish after it, and none is asked for after it "
        "(tests/executor/test_optuna_parity.py checks that)"
        for name in (
            _STUDY + "test_stop_in_callback",
            _STUDY + "test_stop_in_objective",
            _STUDY + "test_stop_n_jobs",
            "tests/test_callbacks.py::test_stop_with_MaxTrialsCallback",
        )
    }
)


def expected_different(k: int, isolation: str = "threads") -> dict[str, str]:
    """The node ids expected to differ with ``trials_per_device=k``, with the reason of each.

    ``isolation="process"`` adds :data:`_PROCESS`: what an objective run in another process
    cannot do in the test's own (mutate the test's objects, be patched by the test).
    """
    expected = {**_ALWAYS, **(_CONCURRENT if k > 1 else _SEQUENTIAL)}
    if isolation == "process":
        expected.update(_PROCESS)
    return expected
