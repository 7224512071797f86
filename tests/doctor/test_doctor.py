"""``waterwave-hpo doctor`` on the CPU: the simulated device's checks, the report, exit codes."""

from __future__ import annotations

import json
from pathlib import Path
import shutil
import subprocess
import sys

import pytest
import torch

from waterwave_hpo.cli import main
from waterwave_hpo.doctor import CheckResult
from waterwave_hpo.doctor import CheckStatus
from waterwave_hpo.doctor import _checks
from waterwave_hpo.doctor import _features

CHECKS = [
    "pool_library",
    "torch_shim",
    "install_order",
    "alloc_latency",
    "canary",
    "oom",
    "cudnn_conv",
    "cohosted_study",
    "cupy_stream",
    "home_plans",
    "oom_in_backward",
    "cupy_oom",
    "laysa_bf16",
    "fused_batch",
    "every_gpu",
    "late_path",
    "worker_crash",
]


@pytest.mark.slow
def test_the_command_runs_on_a_machine_without_a_gpu(tmp_path: Path) -> None:
    exe = shutil.which("waterwave-hpo", path=str(Path(sys.executable).parent))
    assert exe is not None
    out = tmp_path / "report.json"
    done = subprocess.run(
        [exe, "doctor", "--device", "cpu", "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "No GPU was found" in done.stdout
    report = json.loads(out.read_text())
    assert report["gpu_found"] is False and report["device"] == "sim"
    assert [c["name"] for c in report["checks"]] == CHECKS
    assert {c["status"] for c in report["checks"]} <= {"PASS", "SKIP"}
    assert report["versions"]["torch"] and report["versions"]["optuna"]
    assert report["exit_code"] == 0


def test_a_failed_check_fails_the_command_and_is_in_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def overwritten() -> CheckResult:
        return CheckResult("canary", CheckStatus.FAIL, 3.0, "overwritten blocks", "3 overwritten")

    def crashes() -> CheckResult:
        raise RuntimeError("illegal memory access")

    monkeypatch.setattr(_checks, "check_canary_sim", overwritten)
    monkeypatch.setattr(_checks, "check_oom_sim", crashes)
    monkeypatch.setattr(_checks, "check_cohosted", lambda device: _skip("cohosted_study"))
    monkeypatch.setattr(_features, "FEATURE_CHECKS", ())  # tests/doctor/test_features.py
    out = tmp_path / "r.json"
    assert main(["doctor", "--device", "cpu", "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["canary"]["status"] == "FAIL" and by_name["canary"]["figure"] == 3.0
    assert by_name["oom"]["status"] == "FAIL"
    assert "RuntimeError: illegal memory access" in by_name["oom"]["detail"]
    assert by_name["pool_library"]["status"] == "PASS"  # the others still ran
    assert report["exit_code"] == 1
    assert "FAIL  canary" in capsys.readouterr().out


def test_a_device_that_does_not_exist_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", "--device", "cuda:7", "--json", str(tmp_path / "r.json")]) == 2
    assert "no such CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_the_simulated_canary_catches_an_overwrite(monkeypatch: pytest.MonkeyPatch) -> None:
    # A pool that hands out a live block again must fail the canary.
    from waterwave_hpo.memory import StreamAwarePool

    original = StreamAwarePool.allocate
    first: dict[str, int] = {}

    def reuse_live(self: StreamAwarePool, nbytes: int, stream: object = None) -> int:
        ptr = original(self, nbytes, stream)  # type: ignore[arg-type]
        if "ptr" not in first:
            first["ptr"] = ptr
            return ptr
        if nbytes <= 4096:
            return first["ptr"]  # the first block, still live: any write overwrites it
        return ptr

    monkeypatch.setattr(StreamAwarePool, "allocate", reuse_live)
    result = _checks.check_canary_sim(rounds=200)
    assert result.status is CheckStatus.FAIL
    assert result.figure is not None and result.figure > 0  # overwritten blocks were seen


def _skip(name: str) -> CheckResult:
    return CheckResult(name, CheckStatus.SKIP, None, "", "skipped in this test")


def test_on_a_gpu_nothing_initialises_cuda_before_the_pool_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fakes.cuda_init import FakeCuda

    from waterwave_hpo.doctor import run_doctor

    cuda = FakeCuda(n=1).install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: cuda._init() or "fake GPU")
    order: list[str] = []

    def install_order(device: torch.device) -> CheckResult:
        order.append("cuda init" if cuda.initialised else "clean")
        return _skip("install_order")

    monkeypatch.setattr(_checks, "check_install_order_cuda", install_order)
    for name in ("alloc_latency", "canary", "oom"):
        monkeypatch.setattr(_checks, f"check_{name}_cuda", lambda d, _n=name: _skip(_n))
    monkeypatch.setattr(_checks, "check_cohosted", lambda d: _skip("cohosted_study"))
    monkeypatch.setattr(_checks, "check_cudnn", lambda d: _skip("cudnn_conv"))
    monkeypatch.setattr(
        _features, "FEATURE_CHECKS", tuple((n, lambda d, _n=n: _skip(_n)) for n in CHECKS[8:])
    )
    report = run_doctor("cuda:0")
    assert report.gpu_found and report.device == "cuda:0"
    assert order == ["clean"]  # versions and device lookup did not initialise CUDA
    assert report.machine["gpu"] == "fake GPU"


def test_the_conv_comparison_fails_a_gradient_one_percent_off() -> None:
    # The input gradient of square().mean() is ~2e-5 per element: an absolute tolerance of
    # 1e-4 passed it whatever its values; the comparison is relative to its norm.
    _, grad = _checks._conv_step(torch.device("cpu"))
    assert float(grad.abs().max()) < 1e-3
    assert _checks.conv_matches(grad.clone(), grad)
    assert not _checks.conv_matches(grad * 1.01, grad)
    assert not _checks.conv_matches(grad[:2], grad)  # a shape mismatch never matches
    assert _checks.relative_error(grad * 1.01, grad) == pytest.approx(0.01, rel=1e-6)


def test_the_cudnn_check_fails_when_a_gradient_is_one_percent_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_step = _checks._conv_step
    calls: list[torch.device] = []

    def gradient_off(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        out, grad = real_step(device)
        calls.append(device)
        return (out, grad) if len(calls) == 1 else (out, grad * 1.01)  # the reference is right

    assert _checks.check_cudnn(torch.device("cpu")).status is CheckStatus.PASS
    monkeypatch.setattr(_checks, "_conv_step", gradient_off)
    result = _checks.check_cudnn(torch.device("cpu"))
    assert result.status is CheckStatus.FAIL, result.detail
    assert "DIFFERS FROM the CPU" in result.detail
    assert result.figure == pytest.approx(0.01, rel=1e-3)
