"""The torch-facing shim: a pool OOM is PyTorch's own c10::OutOfMemoryError.

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


# --- torch 2.14+: C++20, CUDA headers from torch's own packages, "on" fails and "auto" warns ---


def test_the_shim_is_compiled_as_cxx20_which_c10_needs_from_torch_2_14(tmp_path: Path) -> None:
    argv, _ = shim_command(tmp_path / "x.so")
    assert "-std=c++20" in argv
    assert "-Wl,--no-undefined" in argv  # an unresolved symbol fails the build, not the load


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A site-packages with torch's CUDA 13 package, lacking crt/ as torch 2.15's does."""
    from waterwave_hpo.memory import _shim

    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(_shim, "SYSTEM_CUDA_HOME", tmp_path / "no_system_toolkit")
    site = tmp_path / "site-packages"
    (site / "torch").mkdir(parents=True)
    _touch(site / "nvidia" / "cu13" / "include" / "cuda_runtime_api.h")
    return site


def test_cuda_headers_come_from_torchs_own_package_completed_by_tritons_crt(site: Path) -> None:
    from waterwave_hpo.memory._shim import cuda_include_dirs

    runtime = site / "nvidia" / "cu13" / "include"
    assert cuda_include_dirs(site / "torch") == [runtime]  # no crt anywhere: the compiler says so
    triton = site / "triton" / "backends" / "nvidia" / "include"
    _touch(triton / "crt" / "host_config.h")
    _touch(triton / "cuda_runtime_api.h")
    assert cuda_include_dirs(site / "torch") == [runtime, triton]
    _touch(runtime / "crt" / "host_config.h")  # cuda-toolkit[crt] installed: one directory
    assert cuda_include_dirs(site / "torch") == [runtime]


def test_cuda_home_is_preferred_then_the_system_toolkit_is_the_last_resort(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from waterwave_hpo.memory import _shim
    from waterwave_hpo.memory._shim import cuda_include_dirs

    system = tmp_path / "system_cuda"
    _touch(system / "include" / "cuda_runtime_api.h")
    _touch(system / "include" / "crt" / "host_config.h")
    monkeypatch.setattr(_shim, "SYSTEM_CUDA_HOME", system)
    runtime = site / "nvidia" / "cu13" / "include"
    assert cuda_include_dirs(site / "torch") == [runtime, system / "include"]
    home = tmp_path / "my_cuda"
    _touch(home / "include" / "cuda_runtime_api.h")
    _touch(home / "include" / "crt" / "host_config.h")
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert cuda_include_dirs(site / "torch") == [home / "include"]


@pytest.fixture
def failing_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """$CXX is a compiler that fails with a message; a fresh shim cache; nothing warned yet."""
    from waterwave_hpo.memory import _shim

    cxx = tmp_path / "fake-c++"
    message = "fake-c++: error: 'std::strong_ordering' is only available from C++20 onwards"
    cxx.write_text(f'#!/bin/sh\necho "{message}" >&2\nexit 1\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("WATERWAVE_HPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_shim, "_warned", False)
    _shim.torch_shim.cache_clear()
    yield message
    _shim.torch_shim.cache_clear()


def test_a_required_shim_that_cannot_be_built_raises_with_the_compilers_message(
    failing_compiler: str,
) -> None:
    from waterwave_hpo.memory._shim import shim_for_pool

    with pytest.raises(ShimBuildError, match="only available from C\\+\\+20") as info:
        shim_for_pool(required=True)
    assert "waterwave-hpo doctor" in str(info.value)


def test_an_optional_shim_that_cannot_be_built_warns_once_with_the_compilers_message(
    failing_compiler: str,
) -> None:
    import warnings

    from waterwave_hpo.memory._shim import ShimBuildWarning
    from waterwave_hpo.memory._shim import shim_for_pool

    with pytest.warns(ShimBuildWarning, match="only available from C\\+\\+20"):
        shim, problem = shim_for_pool(required=False)
    assert shim is None and failing_compiler in problem
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shim, again = shim_for_pool(required=False)  # a second device: no second warning
    assert shim is None and failing_compiler in again


def test_a_cuda_torch_whose_cuda_variant_fails_is_incomplete_on_and_warned_on_auto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from waterwave_hpo.memory import _shim

    real = _shim.shim_command

    def cuda_variant_breaks(
        output: Path, *, cxx: str | None = None, with_record_stream: bool = True
    ) -> tuple[list[str], bool]:
        argv, _ = real(output, cxx=cxx, with_record_stream=False)
        if with_record_stream:  # as torch 2.15's c10/cuda headers did under -std=c++17
            return [*argv, "-include", "no/such/cuda_header.h"], True
        return argv, False

    monkeypatch.setattr(_shim, "shim_command", cuda_variant_breaks)
    monkeypatch.setattr(torch.version, "cuda", "13.2")  # torch as a CUDA build
    monkeypatch.setenv("WATERWAVE_HPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_shim, "_warned", False)
    _shim.torch_shim.cache_clear()
    try:
        with pytest.raises(ShimBuildError, match=r"no/such/cuda_header\.h"):
            _shim.shim_for_pool(required=True)
        with pytest.warns(_shim.ShimBuildWarning, match="without its CUDA variant"):
            shim, problem = _shim.shim_for_pool(required=False)
        assert shim is not None and not shim.has_record_stream  # the typed OOM still works
        assert "no/such/cuda_header.h" in problem
    finally:
        _shim.torch_shim.cache_clear()
