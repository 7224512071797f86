"""One format for argument errors: ``name=value: what is wrong; the fix``."""

from __future__ import annotations

import optuna
import pytest

import waterwave_hpo as ww
from waterwave_hpo import _checks
from waterwave_hpo.memory import PoolOutOfMemoryError
from waterwave_hpo.memory import StreamAwarePool

MiB = 1 << 20


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 bytes"),
        (1023, "1023 bytes"),
        (1024, "1.0 KiB (1024 bytes)"),
        (3435973837, "3.2 GiB (3435973837 bytes)"),
        (5 * (1 << 40), "5.0 TiB (5497558138880 bytes)"),
        (-2048, "-2.0 KiB (-2048 bytes)"),
    ],
)
def test_byte_counts_read_both_ways(nbytes: int, text: str) -> None:
    assert _checks.format_bytes(nbytes) == text


def test_wrong_type_is_a_type_error_and_wrong_value_a_value_error_in_one_format() -> None:
    with pytest.raises(TypeError, match=r"^n=2\.5: must be an int >= 1, not float; pass an int"):
        _checks.check_int("n", 2.5, minimum=1)
    with pytest.raises(TypeError, match=r"^n=True: "):
        _checks.check_int("n", True, minimum=1)
    with pytest.raises(ValueError, match=r"^n=0: must be >= 1; pass an int >= 1\.$"):
        _checks.check_int("n", 0, minimum=1)
    with pytest.raises(ValueError, match=r"^t=nan: must be > 0"):
        _checks.check_number("t", float("nan"))


@pytest.mark.parametrize(
    ("call", "error", "start"),
    [
        (
            lambda: ww.WaterwaveExecutor("cpu", trials_per_device="4"),
            TypeError,
            "trials_per_device='4': ",
        ),
        (
            lambda: ww.WaterwaveExecutor("cpu", max_oom_retries=-1),
            ValueError,
            "max_oom_retries=-1: ",
        ),
        (lambda: ww.WaterwaveExecutor("cpu", on_oom="explode"), ValueError, "on_oom='explode': "),
        (lambda: ww.shared_gpu(trials_per_gpu="many"), TypeError, "trials_per_gpu='many': "),
        (lambda: ww.shared_gpu(trials_per_gpu=0), ValueError, "trials_per_gpu=0: "),
        (lambda: ww.shared_gpu(lease_ttl_s="1"), TypeError, "lease_ttl_s='1': "),
        (lambda: StreamAwarePool(1.5, backend="sim"), TypeError, "capacity_bytes=1.5: "),
        (lambda: StreamAwarePool(backend="sim", device=-1), ValueError, "device=-1: "),
        (lambda: StreamAwarePool(backend="gpu"), ValueError, "backend='gpu': "),
    ],
)
def test_public_entry_points_share_the_format(
    call: object, error: type[Exception], start: str
) -> None:
    with pytest.raises(error) as info:
        call()  # type: ignore[operator]
    message = str(info.value)
    assert message.startswith(start), message
    assert "; " in message and message.endswith(".")


def test_optimize_refuses_a_non_study_with_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"^study='x': must be an optuna\.Study, not str; create"):
        ww.WaterwaveExecutor("cpu").optimize("x", lambda t: 0.0, n_trials=1)  # type: ignore[arg-type]
    study = optuna.create_study()
    with pytest.raises(TypeError, match=r"^callbacks\[1\]=3: must be a callable"):
        ww.WaterwaveExecutor("cpu").optimize(study, lambda t: 0.0, callbacks=[print, 3])
    assert study.trials == []


def test_the_cpp_pool_prints_byte_counts_readably() -> None:
    pool = StreamAwarePool(4 * MiB, backend="sim")
    pool.allocate(3 * MiB, 1)
    with pytest.raises(PoolOutOfMemoryError) as info:
        pool.allocate(3 * MiB, 2)
    message = str(info.value)
    assert "3.0 MiB (3145728 bytes)" in message, message
    assert "capacity of 4.0 MiB (4194304 bytes)" in message, message
