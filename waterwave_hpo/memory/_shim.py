"""Builds and loads the torch-facing shim of the pool (``allocator_ext/torch_shim/``).

A pluggable allocator's C++ exception reaches PyTorch as a plain ``RuntimeError`` unless it is
PyTorch's own ``c10::OutOfMemoryError``; only that type makes PyTorch's internal recovery run
(cuDNN v8 retries with a smaller workspace) and surfaces as ``torch.OutOfMemoryError`` (issue 14,
section 1.2). The shim throws it, so it must be compiled against the headers of the torch that
runs and linked to its ``libc10.so``; the package build has no torch, so the shim is built here, at
first CUDA use, with the C++ compiler into a per-user cache (a second or so). On a CUDA build of
torch it also registers the pool's record-stream hook with the pluggable allocator (section 1.4).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
from pathlib import Path
import shutil
import subprocess
import tempfile

from waterwave_hpo.memory._lib import library_path
from waterwave_hpo.memory._lib import load_library

#: Set to ``0`` to never build the shim (the plain entry points and :func:`translate_oom` remain).
SHIM_ENV_VAR = "WATERWAVE_HPO_TORCH_SHIM"
#: Directory for built shims (default ``~/.cache/waterwave_hpo/torch_shim``).
CACHE_ENV_VAR = "WATERWAVE_HPO_CACHE"
SHIM_SOURCE_NAME = "waterwave_torch_shim.cpp"
SHIM_MALLOC = "waterwave_shim_malloc"
SHIM_FREE = "waterwave_shim_free"


class ShimBuildError(RuntimeError):
    """The torch shim could not be built (no compiler, no torch headers, a compile error)."""


@dataclasses.dataclass(frozen=True)
class TorchShim:
    """A built and loaded torch shim.

    Attributes:
        path: The shared library, for ``CUDAPluggableAllocator(path, SHIM_MALLOC, SHIM_FREE)``.
        library: The loaded library (ctypes).
        has_record_stream: Built against torch's CUDA library: can register ``record_stream``.
    """

    path: Path
    library: ctypes.CDLL
    has_record_stream: bool


def _source_dir() -> Path:
    """Where the shim source and ``waterwave_pool.h`` are.

    Where the shim source and ``waterwave_pool.h`` are: installed next to the library, or the
    repository's ``allocator_ext`` (a sanitizer build through ``$WATERWAVE_HPO_POOL_LIBRARY``).
    """
    installed = Path(__file__).resolve().parent.parent / "_lib"
    if (installed / SHIM_SOURCE_NAME).is_file():
        return installed
    repo = Path(__file__).resolve().parents[2] / "allocator_ext"
    if (repo / "torch_shim" / SHIM_SOURCE_NAME).is_file():
        return repo
    raise ShimBuildError(
        f"The torch shim source {SHIM_SOURCE_NAME} is not installed next to {library_path()}; "
        "reinstall the package with `pip install .`."
    )


def _cuda_include_dirs(torch_dir: Path) -> list[Path]:
    """Directories with ``cuda_runtime_api.h``: the CUDA toolkit, or the ``nvidia-*`` wheels."""
    found: list[Path] = []
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda_runtime_api.h").is_file():
            found.append(Path(home) / "include")
    site = torch_dir.parent / "nvidia"
    for header in sorted(site.glob("*/include/cuda_runtime_api.h")):
        found.append(header.parent)
    return found[:1]


def shim_command(
    output: Path, *, cxx: str | None = None, with_record_stream: bool = True
) -> tuple[list[str], bool]:
    """The compiler command that builds the shim into ``output`` for the torch that runs.

    Args:
        output: The shared library to write.
        cxx: The C++ compiler (default ``$CXX``, then ``g++``, then ``c++``).
        with_record_stream: Build the record-stream registration where torch is a CUDA build
            (False: the typed OOM only).

    Returns:
        ``(argv, with_record_stream)``: with_record_stream is True when torch is a CUDA build
        whose ``libtorch_cuda.so`` and CUDA runtime headers are present.

    Raises:
        ShimBuildError: No C++ compiler, or torch ships no C++ headers.
    """
    import torch

    compiler = cxx or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise ShimBuildError("No C++ compiler (g++ or c++ on PATH, or $CXX) to build the shim.")
    torch_dir = Path(torch.__file__).resolve().parent
    include = torch_dir / "include"
    if not (include / "c10" / "util" / "Exception.h").is_file():
        raise ShimBuildError(f"torch {torch.__version__} ships no C++ headers under {include}.")
    lib_dir = library_path().resolve().parent
    src_dir = _source_dir()
    source = src_dir / SHIM_SOURCE_NAME
    if not source.is_file():
        source = src_dir / "torch_shim" / SHIM_SOURCE_NAME
    header_dir = src_dir if (src_dir / "waterwave_pool.h").is_file() else src_dir / "include"
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    torch_lib = torch_dir / "lib"
    argv = [
        compiler,
        "-std=c++17",
        "-O2",
        "-shared",
        "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{include}",
        f"-I{header_dir}",
    ]
    cuda_includes = _cuda_include_dirs(torch_dir)
    with_cuda = (
        with_record_stream
        and torch.version.cuda is not None
        and (torch_lib / "libtorch_cuda.so").is_file()
        and (include / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").is_file()
        and bool(cuda_includes)
    )
    if with_cuda:
        argv += ["-DWATERWAVE_SHIM_TORCH_CUDA", *(f"-I{d}" for d in cuda_includes)]
    argv += [str(source), "-o", str(output), f"-L{torch_lib}", "-lc10"]
    if with_cuda:
        argv += ["-lc10_cuda", "-ltorch_cuda", "-ltorch_cpu"]
    argv += [
        f"-Wl,-rpath,{torch_lib}",
        f"-L{lib_dir}",
        f"-l:{library_path().name}",
        f"-Wl,-rpath,{lib_dir}",
    ]
    return argv, with_cuda


def build_shim(cache_dir: Path | None = None) -> Path:
    """Builds the shim for the torch that runs (once per torch, pool library and source).

    Args:
        cache_dir: Where to keep it; default ``$WATERWAVE_HPO_CACHE`` or
            ``~/.cache/waterwave_hpo/torch_shim``.

    Returns:
        The path of the built shared library.

    Raises:
        ShimBuildError: No compiler or headers, or the compiler failed (its output attached).
    """
    import torch

    root = cache_dir or Path(
        os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "waterwave_hpo"
    )
    root = root / "torch_shim"
    probe, _ = shim_command(Path("OUT"))
    digest = hashlib.sha256()
    for part in (*probe, torch.__version__, str(library_path().resolve())):
        digest.update(part.encode())
    for path in (_source_dir().rglob(SHIM_SOURCE_NAME), _source_dir().rglob("waterwave_pool.h")):
        for p in path:
            digest.update(p.read_bytes())
    target = root / digest.hexdigest()[:16] / "libwaterwave_torch_shim.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        argv, with_cuda = shim_command(out)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if done.returncode != 0 and with_cuda:
            # The record-stream part needs torch's CUDA headers and libraries to agree with the
            # CUDA headers found; without it the typed OOM still works (said once at run time).
            (target.parent / "record_stream_build_error.txt").write_text(
                f"{' '.join(argv)}\n{done.stderr[-3000:]}"
            )
            argv, _ = shim_command(out, with_record_stream=False)
            done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise ShimBuildError(
                f"Building the torch shim failed ({' '.join(argv)}):\n{done.stderr[-3000:]}"
            )
        os.replace(out, target)  # atomic: concurrent processes build the same file
    return target


def record_stream_build_error(shim_path: Path) -> str:
    """Why the shim was built without the record-stream part.

    Why the shim at ``shim_path`` was built without the record-stream part ("" if it was not
    attempted or succeeded).
    """
    note = shim_path.parent / "record_stream_build_error.txt"
    return note.read_text() if note.is_file() else ""


@functools.lru_cache(maxsize=1)
def torch_shim() -> TorchShim:
    """The shim for this process, built on first call and loaded once.

    Raises:
        ShimBuildError: ``$WATERWAVE_HPO_TORCH_SHIM`` is ``0``, or the build or load failed.
    """
    if os.environ.get(SHIM_ENV_VAR, "1") == "0":
        raise ShimBuildError(f"The torch shim is disabled (${SHIM_ENV_VAR}=0).")
    load_library()  # the shim links to this very pool library: load it first, same instance
    path = build_shim()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise ShimBuildError(f"Cannot load the torch shim {path}: {exc}") from exc
    lib.waterwave_shim_probe.restype = ctypes.c_int
    lib.waterwave_shim_probe.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.waterwave_shim_has_record_stream.restype = ctypes.c_int
    lib.waterwave_shim_register_record_stream.restype = ctypes.c_int
    return TorchShim(path, lib, bool(lib.waterwave_shim_has_record_stream()))
