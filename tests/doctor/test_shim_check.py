"""``waterwave-hpo doctor``'s ``torch_shim`` check: compiles and links the shim against this torch.

On a CUDA wheel (no GPU: torch 2.15.0's in CI's first lane, 2.9.1's in its second) it must build
the CUDA variant; on a CPU build the CPU variant. A compiler that fails, or CUDA headers that
cannot be found, are a FAIL with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from waterwave_hpo.doctor import CheckStatus
from waterwave_hpo.doctor._checks import guarded
from waterwave_hpo.doctor._shim_check import check_torch_shim


def test_the_shim_compiles_links_and_throws_torchs_oom_for_the_installed_torch() -> None:
    result = guarded("torch_shim", check_torch_shim)
    assert result.status is CheckStatus.PASS, result.detail
    assert f"torch {torch.__version__}" in result.detail and "-std=c++20" in result.detail
    assert "is c10::OutOfMemoryError" in result.detail
    if torch.version.cuda is not None:  # the CUDA wheel: the variant linked to libtorch_cuda
        assert "CUDA variant" in result.detail and "CUDA headers from" in result.detail
    else:
        assert "CPU variant" in result.detail
    assert result.unit == "s" and result.figure is not None and result.figure > 0


def test_a_compiler_error_is_a_fail_with_the_compilers_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cxx = tmp_path / "fake-c++"
    cxx.write_text(
        "#!/bin/sh\necho \"intrusive_ptr.h:775: error: 'strong_ordering' in namespace 'std' "
        'does not name a type" >&2\nexit 1\n'
    )
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    result = guarded("torch_shim", check_torch_shim)
    assert result.status is CheckStatus.FAIL
    assert "'strong_ordering' in namespace 'std' does not name a type" in result.detail
    assert "(exit 1)" in result.detail and str(cxx) in result.detail  # the command too


def test_a_cuda_torch_without_cuda_headers_is_a_fail_naming_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from waterwave_hpo.memory import _shim

    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "13.2")
    monkeypatch.setattr(_shim, "_cuda_header_candidates", lambda torch_dir: [tmp_path])
    result = guarded("torch_shim", check_torch_shim)
    assert result.status is CheckStatus.FAIL
    assert "the CUDA variant of the shim cannot be built" in result.detail
    # A CPU wheel posing as CUDA has no libtorch_cuda.so; the CUDA wheel has no headers here.
    assert "libtorch_cuda.so" in result.detail or "no CUDA runtime headers" in result.detail
