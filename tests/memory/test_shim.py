"""The torch-facing shim (issue 14, section 1.2): a pool OOM is PyTorch's own c10::OutOfMemoryError.

Built here against the headers of the installed torch (a CPU build: no CUDA needed for this part)
and driven through its probe entry point, which calls the allocator function PyTorch would call
and reports the C++ type it threw.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from waterwave_hpo.memory import StreamAwarePool
from waterwave_hpo.memory._lib import load_library
from waterwave_hpo.memory._shim import ShimBuildError
from waterwave_hpo.memory._shim import build_shim
from waterwave_hpo.memory._shim import record_stream_build_error
from waterwave_hpo.memory._shim import shim_command

torch = pytest.importorskip("torch")
MiB = 1 << 20
NOTHING, TORCH_OOM, TORCH_ERROR, OTHER = 0, 1, 2, 3


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    try:
        path = build_shim(tmp_path_factory.mktemp("cache"))
    except ShimBuildError as exc:
        if "No C++ compiler" in str(exc):
            pytest.skip(str(exc))
        raise
    lib = ctypes.CDLL(str(path))
    lib.waterwave_shim_probe.restype = ctypes.c_int
    lib.waterwave_shim_probe.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return lib


def test_pool_exhaustion_through_the_shim_is_c10_out_of_memory_error(shim: ctypes.CDLL) -> None:
    pool = StreamAwarePool(2 * MiB, backend="sim")
    lib = load_library()
    lib.ww_torch_set_pool(7, pool._handle())  # device 7: no real device is touched
    try:
        assert shim.waterwave_shim_probe(1 * MiB, 7, 1) == NOTHING
        assert shim.waterwave_shim_probe(4 * MiB, 7, 1) == TORCH_OOM
        assert pool.stats().allocated_bytes == 0
    finally:
        lib.ww_torch_set_pool(7, None)
        pool.close()


def test_no_pool_through_the_shim_is_a_torch_error_not_an_oom(shim: ctypes.CDLL) -> None:
    assert shim.waterwave_shim_probe(4096, 9, 0) == TORCH_ERROR


def test_shim_links_to_the_loaded_pool_library(tmp_path: Path) -> None:
    argv, _ = shim_command(tmp_path / "x.so")
    assert any("-lc10" == a for a in argv)
    assert any(a.startswith("-l:libwaterwave_pool") for a in argv)


def test_record_stream_registration_compiles_against_a_cuda_torch(tmp_path: Path) -> None:
    _, with_cuda = shim_command(tmp_path / "x.so")
    if torch.version.cuda is None:
        pytest.skip(
            f"torch {torch.__version__} is a CPU build: no libtorch_cuda.so or c10/cuda headers "
            "to compile the record-stream registration against"
        )
    if not with_cuda:
        pytest.skip("no CUDA runtime headers (CUDA_HOME, /usr/local/cuda or nvidia-* wheels)")
    path = build_shim(tmp_path)
    lib = ctypes.CDLL(str(path))
    assert lib.waterwave_shim_has_record_stream() == 1, record_stream_build_error(path)


def test_a_failing_record_stream_build_falls_back_to_the_typed_oom_shim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from waterwave_hpo.memory import _shim

    real = _shim.shim_command

    def cuda_variant_breaks(
        output: Path, *, cxx: str | None = None, with_record_stream: bool = True
    ) -> tuple[list[str], bool]:
        argv, _ = real(output, cxx=cxx, with_record_stream=False)
        if with_record_stream:  # as if torch's CUDA headers disagreed with the CUDA found
            return [*argv, "-include", "no/such/cuda_header.h"], True
        return argv, False

    monkeypatch.setattr(_shim, "shim_command", cuda_variant_breaks)
    path = build_shim(tmp_path)
    lib = ctypes.CDLL(str(path))
    assert lib.waterwave_shim_has_record_stream() == 0
    assert "no/such/cuda_header.h" in record_stream_build_error(path)
