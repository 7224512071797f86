"""Bad arguments to the executors, the study helpers and the trial context (table-driven).

Every case: the exception type, the argument, the value and a fix in the message; no trial
asked for (the study stays empty); nothing left RUNNING.
"""

from __future__ import annotations

from collections.abc import Callable
import math
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import optuna
import pytest

from badinput._helpers import Case
from badinput._helpers import assert_none_running
from badinput._helpers import case_params
import waterwave_hpo as ww
from waterwave_hpo.executor import NotInTrialError

# -- WaterwaveExecutor(...) -----------------------------------------------------------------


def _executor(**kwargs: Any) -> Callable[[], object]:
    return lambda: ww.WaterwaveExecutor(**kwargs)


CONSTRUCTOR = [
    Case("devices-none", _executor(devices=None), TypeError, "devices", "None", "type"),
    Case("devices-float", _executor(devices=1.5), TypeError, "devices", "1.5", "type"),
    Case("devices-empty", _executor(devices=[]), ValueError, "devices", "[]", "range"),
    Case("devices-tpu", _executor(devices="tpu"), ValueError, "devices", "'tpu'", "range"),
    Case("devices-typo", _executor(devices="cpuu"), ValueError, "devices", "'cpuu'", "range"),
    Case("devices-negative", _executor(devices=-1), ValueError, "devices", "-1", "range"),
    Case("devices-cuda", _executor(devices="cuda"), ValueError, "devices", "'cuda'", "range"),
    Case(
        "devices-auto-in-list",
        _executor(devices=["cpu", "auto"]),
        ValueError,
        "devices",
        "'auto'",
        "range",
    ),
    Case("devices-bool", _executor(devices=[True]), TypeError, "devices", "True", "type"),
    Case("tpd-zero", _executor(trials_per_device=0), ValueError, "trials_per_device", "0", "range"),
    Case(
        "tpd-negative",
        _executor(trials_per_device=-3),
        ValueError,
        "trials_per_device",
        "-3",
        "range",
    ),
    Case(
        "tpd-word",
        _executor(trials_per_device="four"),
        TypeError,
        "trials_per_device",
        "'four'",
        "type",
    ),
    Case(
        "tpd-float", _executor(trials_per_device=2.5), TypeError, "trials_per_device", "2.5", "type"
    ),
    Case(
        "tpd-bool",
        _executor(trials_per_device=True),
        TypeError,
        "trials_per_device",
        "True",
        "type",
    ),
    Case(
        "tpd-absurd",
        _executor(trials_per_device=2_000_000),
        ValueError,
        "trials_per_device",
        "2000000",
        "absurd",
    ),
    Case(
        "max-tpd-absurd",
        _executor(trials_per_device="auto", max_trials_per_device=10**9),
        ValueError,
        "max_trials_per_device",
        "1000000000",
        "absurd",
    ),
    Case(
        "max-tpd-zero",
        _executor(max_trials_per_device=0),
        ValueError,
        "max_trials_per_device",
        "0",
        "range",
    ),
    Case("on-oom-word", _executor(on_oom="explode"), ValueError, "on_oom", "'explode'", "range"),
    Case("on-oom-int", _executor(on_oom=3), ValueError, "on_oom", "3", "type"),
    Case(
        "oom-retries-negative",
        _executor(max_oom_retries=-1),
        ValueError,
        "max_oom_retries",
        "-1",
        "range",
    ),
    Case(
        "oom-retries-str",
        _executor(max_oom_retries="2"),
        TypeError,
        "max_oom_retries",
        "'2'",
        "type",
    ),
    Case(
        "budget-zero",
        _executor(memory_budget_bytes=0),
        ValueError,
        "memory_budget_bytes",
        "0",
        "range",
    ),
    Case(
        "budget-str",
        _executor(memory_budget_bytes="1GB"),
        TypeError,
        "memory_budget_bytes",
        "'1GB'",
        "type",
    ),
    Case(
        "budget-float",
        _executor(memory_budget_bytes=1.5e9),
        TypeError,
        "memory_budget_bytes",
        "1500000000.0",
        "type",
    ),
    Case(
        "budget-below-one-byte-per-process-slot",
        _executor(devices="cpu", trials_per_device=4, isolation="process", memory_budget_bytes=3),
        ValueError,
        "memory_budget_bytes",
        "3",
        "range",
    ),
    Case(
        "tpd-processes-beyond-host-memory",
        _executor(devices="cpu", trials_per_device=1000, isolation="process"),
        ValueError,
        "trials_per_device",
        "1000",
        "absurd",
    ),
    Case("policy-word", _executor(policy="lifo"), ValueError, "policy", "'lifo'", "range"),
    Case("policy-int", _executor(policy=3), TypeError, "policy", "3", "type"),
    Case(
        "pool-word", _executor(memory_pool="maybe"), ValueError, "memory_pool", "'maybe'", "range"
    ),
    # "on" raises rather than run without the pool, which holds CUDA memory only.
    Case(
        "pool-on-a-cpu-device",
        _executor(devices="cpu", memory_pool="on"),
        ValueError,
        "memory_pool",
        "'on'",
        "range",
    ),
    Case(
        "attrs-str",
        _executor(record_trial_attrs="yes"),
        TypeError,
        "record_trial_attrs",
        "'yes'",
        "type",
    ),
    Case(
        "plan-word", _executor(memory_plan="always"), ValueError, "memory_plan", "'always'", "range"
    ),
    Case("plan-none", _executor(memory_plan=None), TypeError, "memory_plan", "None", "type"),
    Case(
        "planner-word",
        _executor(memory_planner="best"),
        ValueError,
        "memory_planner",
        "'best'",
        "range",
    ),
    Case("fuse-zero", _executor(fuse=0), ValueError, "fuse", "0", "range"),
    Case("fuse-str", _executor(fuse="8"), TypeError, "fuse", "'8'", "type"),
]


@pytest.mark.parametrize("case", case_params(CONSTRUCTOR))
def test_waterwave_executor_refuses(case: Case) -> None:
    case.check()


# -- WaterwaveExecutor.optimize(...) --------------------------------------------------------


def _good(trial: optuna.trial.Trial) -> float:
    return trial.suggest_float("x", 0.0, 1.0)


def _two_args(trial: optuna.trial.Trial, extra: int) -> float:
    return float(extra)


_STUDY = optuna.create_study()  # stays empty: every case is refused before any trial


def _optimize(func: Any = _good, study: Any = _STUDY, **kwargs: Any) -> Callable[[], object]:
    return lambda: ww.WaterwaveExecutor("cpu", 2).optimize(study, func, **kwargs)


OPTIMIZE = [
    Case("study-str", _optimize(study="s"), TypeError, "study", "'s'", "type"),
    Case("func-int", _optimize(func=3), TypeError, "func", "3", "type"),
    Case("func-no-arg", _optimize(func=lambda: 1.0), TypeError, "func", "lambda", "type"),
    Case("func-two-args", _optimize(func=_two_args), TypeError, "func", "_two_args", "type"),
    Case(
        "func-batched-no-fuse",
        _optimize(func=ww.batched(lambda trials: [1.0] * len(trials))),
        ValueError,
        "fuse",
        "None",
        "type",
    ),
    Case("n-trials-negative", _optimize(n_trials=-1), ValueError, "n_trials", "-1", "range"),
    Case("n-trials-str", _optimize(n_trials="5"), TypeError, "n_trials", "'5'", "type"),
    Case("n-trials-float", _optimize(n_trials=2.5), TypeError, "n_trials", "2.5", "type"),
    Case("n-trials-bool", _optimize(n_trials=True), TypeError, "n_trials", "True", "type"),
    Case("timeout-zero", _optimize(timeout=0), ValueError, "timeout", "0", "range"),
    Case("timeout-negative", _optimize(timeout=-5.0), ValueError, "timeout", "-5.0", "range"),
    Case("timeout-nan", _optimize(timeout=math.nan), ValueError, "timeout", "nan", "range"),
    Case("timeout-str", _optimize(timeout="10"), TypeError, "timeout", "'10'", "type"),
    Case(
        "catch-instance", _optimize(catch=ValueError()), TypeError, "catch", "ValueError()", "type"
    ),
    Case("catch-str", _optimize(catch="ValueError"), TypeError, "catch", "'ValueError'", "type"),
    Case("catch-list-int", _optimize(catch=[3]), TypeError, "catch[0]", "3", "type"),
    Case("callbacks-callable", _optimize(callbacks=print), TypeError, "callbacks", "print", "type"),
    Case("callbacks-int", _optimize(callbacks=[3]), TypeError, "callbacks[0]", "3", "type"),
    Case(
        "storage-in-memory-sqlite",
        _optimize(study=optuna.create_study(storage="sqlite:///:memory:")),
        ValueError,
        "sqlite:///:memory:",
        "in-memory SQLite",
        "storage",
    ),
]


def test_the_process_slot_cap_names_both_figures_and_the_most_that_fit() -> None:
    from waterwave_hpo.executor._isolation import check_process_slots

    with pytest.raises(
        ValueError, match=r"trials_per_device=8: 8 worker processes .* 4\.3 GiB"
    ) as e:
        check_process_slots(8, 1, None, available_bytes=2 * 2**30)
    assert "pass trials_per_device <= 3" in str(e.value) and "2.0 GiB" in str(e.value)
    check_process_slots(3, 1, None, available_bytes=2 * 2**30)  # 3 workers fit in 2 GiB
    with pytest.raises(ValueError, match=r"memory_budget_bytes=3: .*trials_per_device=4"):
        check_process_slots(4, 1, 3, available_bytes=2**40)


@pytest.mark.parametrize("case", case_params(OPTIMIZE))
def test_optimize_refuses_before_any_trial(case: Case) -> None:
    case.check()
    assert _STUDY.trials == []


def test_fused_executor_refuses_an_unbatched_objective() -> None:
    study = optuna.create_study()
    Case(
        "fuse-unbatched",
        lambda: ww.WaterwaveExecutor("cpu", 1, fuse=2).optimize(study, _good, n_trials=2),
        TypeError,
        "func",
        "_good",
        "type",
    ).check()
    assert study.trials == []


# -- Study.optimize(executor=...), create_study, load_study, wrap_study -----------------------


def _study_optimize(**kwargs: Any) -> Callable[[], object]:
    return lambda: ww.create_study().optimize(_good, n_trials=1, **kwargs)


def _journal(tmp: Path) -> str:
    return str(tmp / "x.log")


STUDIES = [
    Case("executor-str", _study_optimize(executor="cpu"), TypeError, "executor", "'cpu'", "type"),
    Case(
        "n-jobs-with-executor",
        _study_optimize(executor=ww.WaterwaveExecutor("cpu"), n_jobs=2),
        ValueError,
        "n_jobs",
        "2",
        "range",
    ),
    Case(
        "storage-path",
        lambda: ww.create_study(storage="runs/x.log"),
        ValueError,
        "storage",
        "'runs/x.log'",
        "path",
    ),
    Case("storage-int", lambda: ww.create_study(storage=3), TypeError, "storage", "3", "type"),
    Case(
        "storage-dialect",
        lambda: ww.create_study(storage="nosuchdb://x"),
        ValueError,
        "storage",
        "'nosuchdb://x'",
        "storage",
    ),
    Case(
        "storage-missing-dir",
        lambda: ww.create_study(storage="sqlite:////nonexistent-dir/x.db"),
        ValueError,
        "storage",
        "nonexistent-dir",
        "path",
    ),
    Case(
        "load-storage-path",
        lambda: ww.load_study(study_name="s", storage="x.db"),
        ValueError,
        "storage",
        "'x.db'",
        "path",
    ),
    Case(
        "load-missing-study",
        lambda: ww.load_study(study_name="nope", storage=optuna.storages.InMemoryStorage()),
        KeyError,
        "study_name",
        "'nope'",
        "range",
    ),
    Case("wrap-str", lambda: ww.wrap_study("s"), TypeError, "study", "'s'", "type"),
    Case("batched-int", lambda: ww.batched(3), TypeError, "func", "3", "type"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("case", case_params(STUDIES))
def test_study_helpers_refuse(case: Case) -> None:
    case.check()


# -- the trial context, called outside a trial ----------------------------------------------


OUTSIDE = [
    Case("current", ww.current, NotInTrialError, "current()", "outside", "order"),
]


@pytest.mark.parametrize("case", case_params(OUTSIDE))
def test_trial_context_outside_a_trial(case: Case) -> None:
    case.check()
    assert ww.current_or_none() is None
    assert ww.trial_memory_stats() is None  # documented: None outside a trial


# -- RayExecutor(...), shared_gpu(...), tune_hosts(...): checked before Ray starts -----------

ray = pytest.importorskip("ray")


def _ray(**kwargs: Any) -> Callable[[], object]:
    return lambda: ww.RayExecutor(**kwargs)


CLUSTER = [
    Case("n-hosts-zero", _ray(n_hosts=0), ValueError, "n_hosts", "0", "range"),
    Case("n-hosts-word", _ray(n_hosts="two"), TypeError, "n_hosts", "'two'", "type"),
    Case(
        "gpus-per-host-2", _ray(num_gpus_per_host=2), ValueError, "num_gpus_per_host", "2", "range"
    ),
    Case(
        "cpus-per-host-zero",
        _ray(num_cpus_per_host=0),
        ValueError,
        "num_cpus_per_host",
        "0",
        "range",
    ),
    Case(
        "resources-gpu",
        _ray(host_resources={"GPU": 1}),
        ValueError,
        "host_resources['GPU']",
        "1",
        "range",
    ),
    Case("resources-list", _ray(host_resources=[1]), TypeError, "host_resources", "[1]", "type"),
    Case("max-devices-zero", _ray(max_devices=0), ValueError, "max_devices", "0", "range"),
    Case(
        "max-devices-below",
        _ray(n_hosts=3, max_devices=2),
        ValueError,
        "max_devices=2",
        "n_hosts=3",
        "range",
    ),
    Case(
        "host-retries-negative",
        _ray(max_host_retries=-1),
        ValueError,
        "max_host_retries",
        "-1",
        "range",
    ),
    Case(
        "startup-timeout-zero",
        _ray(startup_timeout_s=0),
        ValueError,
        "startup_timeout_s",
        "0",
        "range",
    ),
    Case(
        "auto-hosts-cpu",
        _ray(num_gpus_per_host=0),
        ValueError,
        "n_hosts='auto'",
        "num_gpus_per_host=0",
        "range",
    ),
    Case(
        "ray-tpd-absurd",
        _ray(trials_per_device=10**7),
        ValueError,
        "trials_per_device",
        "10000000",
        "absurd",
    ),
    Case(
        "shared-gpu-zero",
        lambda: ww.shared_gpu(trials_per_gpu=0),
        ValueError,
        "trials_per_gpu",
        "0",
        "range",
    ),
    Case(
        "shared-gpu-cpus",
        lambda: ww.shared_gpu(cpus_per_trial=-1),
        ValueError,
        "cpus_per_trial",
        "-1",
        "range",
    ),
    Case(
        "shared-gpu-budget",
        lambda: ww.shared_gpu(memory_budget_bytes=0),
        ValueError,
        "memory_budget_bytes",
        "0",
        "range",
    ),
    Case(
        "tune-hosts-zero",
        lambda: ww.tune_hosts(trials_per_gpu=0),
        ValueError,
        "trials_per_gpu",
        "0",
        "range",
    ),
    Case("tune-hosts-n", lambda: ww.tune_hosts(n_hosts=0), ValueError, "n_hosts", "0", "range"),
    Case(
        "tune-hosts-policy",
        lambda: ww.tune_hosts(policy="lifo"),
        ValueError,
        "policy",
        "'lifo'",
        "range",
    ),
    Case(
        "tune-hosts-pool",
        lambda: ww.tune_hosts(memory_pool="maybe"),
        ValueError,
        "memory_pool",
        "'maybe'",
        "range",
    ),
    Case(
        "tune-hosts-ttl",
        lambda: ww.tune_hosts(heartbeat_ttl_s=0),
        ValueError,
        "heartbeat_ttl_s",
        "0",
        "range",
    ),
]


@pytest.mark.parametrize("case", case_params(CLUSTER))
def test_cluster_arguments_are_refused_without_starting_ray(case: Case) -> None:
    started = ray.is_initialized()
    case.check()
    assert ray.is_initialized() == started


def test_ray_optimize_refuses_each_bad_argument_before_ray(tmp_path: Path) -> None:
    if ray.is_initialized():
        ray.shutdown()
    study = optuna.create_study()
    executor = ww.RayExecutor(n_hosts=1, num_gpus_per_host=0)
    for kwargs, error, match in [
        ({"n_trials": -3}, ValueError, r"n_trials=-3"),
        ({"timeout": 0}, ValueError, r"timeout=0"),
        ({"catch": "x"}, TypeError, r"catch='x'"),
        ({"callbacks": [1]}, TypeError, r"callbacks\[0\]=1"),
    ]:
        with pytest.raises(error, match=match):
            executor.optimize(study, _good, **kwargs)
    with pytest.raises(TypeError, match=r"study='s'"):
        executor.optimize("s", _good)  # type: ignore[arg-type]
    assert not ray.is_initialized()
    assert_none_running(study)
    assert study.trials == []


@settings(max_examples=25, deadline=None)
@given(
    value=st.one_of(
        st.integers(min_value=-(2**40), max_value=2**40),
        st.floats(allow_nan=True),
        st.text(max_size=4),
        st.none(),
        st.booleans(),
    )
)
def test_trials_per_device_accepted_exactly_in_range_else_named(value: object) -> None:
    """Any trials_per_device: an int in [1, 1024] (or 'auto') is kept; all else is refused."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1024:
        assert ww.WaterwaveExecutor("cpu", value).trials_per_device == value
        return
    if value == "auto":
        return
    with pytest.raises((TypeError, ValueError), match=r"^trials_per_device=") as caught:
        ww.WaterwaveExecutor("cpu", value)  # type: ignore[arg-type]
    assert repr(value) in str(caught.value) and "pass" in str(caught.value)
