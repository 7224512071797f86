"""Builds and loads the torch-facing shim of the pool (``allocator_ext/torch_shim/``).

A pluggable allocator's C++ exception reaches PyTorch as a plain ``RuntimeError`` unless it is
PyTorch's own ``c10::OutOfMemoryError``; only that type makes PyTorch's internal recovery run (cuDNN
v8 retries with a smaller workspace) and surfaces as ``torch.OutOfMemoryError``. The shim throws it,
so it must be compiled against the headers of the torch that runs and linked to its ``libc10.so``;
the package build has no torch, so the shim is built here, at first CUDA use, with the C++ compiler
into a per-user cache (a few seconds). On a CUDA build of torch it also registers the pool's
record-stream hook with the pluggable allocator (section 1.4).

It is compiled as C++20 (:data:`CXX_STANDARD`) against every supported torch: c10's headers use
``std::bit_width`` and ``std::strong_ordering`` from torch 2.14 on, ``torch.utils.cpp_extension``
passes ``-std=c++20`` for torch's own extensions from 2.13 on, and the C++17 headers of torch 2.9
to 2.12 compile as C++20 as well (2.9.1 and 2.11.0 checked). The CUDA variant needs the CUDA
runtime headers: ``$CUDA_HOME``/``$CUDA_PATH``, else the ``nvidia-*`` packages torch's wheel
installed, else the copy Triton (a dependency of torch's Linux wheels) bundles, else
``/usr/local/cuda``; torch 2.15's ``nvidia/cu13`` package lacks ``crt/host_config.h``, which is
then taken from the next of these that has it (:func:`cuda_include_dirs`). Whether it builds on
a machine is what ``waterwave-hpo doctor``'s ``torch_shim`` check tells.
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
import threading
import time
import warnings

from waterwave_hpo.memory._lib import library_path
from waterwave_hpo.memory._lib import load_library

#: Set to ``0`` to never build the shim (the plain entry points and :func:`translate_oom` remain).
SHIM_ENV_VAR = "WATERWAVE_HPO_TORCH_SHIM"
#: Directory for built shims (default ``~/.cache/waterwave_hpo/torch_shim``).
CACHE_ENV_VAR = "WATERWAVE_HPO_CACHE"
SHIM_SOURCE_NAME = "waterwave_torch_shim.cpp"
SHIM_MALLOC = "waterwave_shim_malloc"
SHIM_FREE = "waterwave_shim_free"
#: A system CUDA toolkit, the last place CUDA's headers are looked for.
SYSTEM_CUDA_HOME = Path("/usr/local/cuda")
#: The C++ standard the shim is compiled with (what torch's headers need from torch 2.14 on; the
#: C++17 headers of older torch compile with it too).
CXX_STANDARD = "c++20"
#: Characters of the compiler's output kept in messages (head and tail: the first error is at
#: the top of a long output; see :func:`compiler_message`).
_MESSAGE_CHARS = 3000


class ShimBuildError(RuntimeError):
    """The torch shim could not be built (no compiler, no torch headers, a compile error)."""


class ShimBuildWarning(UserWarning):
    """The torch shim (or its CUDA variant) could not be built; the pool runs without it."""


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


def _cuda_header_candidates(torch_dir: Path) -> list[Path]:
    """Include directories that may hold CUDA's runtime headers, in the order they are preferred.

    ``$CUDA_HOME``/``$CUDA_PATH`` (the user's choice), the ``nvidia-*`` packages of torch's wheel
    (the CUDA version torch was built with), the CUDA headers Triton bundles (installed with
    torch's Linux wheels, same CUDA major), then a system toolkit (:data:`SYSTEM_CUDA_HOME`).
    """
    site = torch_dir.parent
    found: list[Path] = []
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home:
            found.append(Path(home) / "include")
    found += sorted(p.parent for p in (site / "nvidia").glob("*/include/cuda_runtime_api.h"))
    found.append(site / "triton" / "backends" / "nvidia" / "include")
    found.append(SYSTEM_CUDA_HOME / "include")
    return found


def cuda_include_dirs(torch_dir: Path) -> list[Path]:
    """The ``-I`` directories for CUDA's runtime headers, or ``[]`` when none are found.

    The first candidate with ``cuda_runtime_api.h``; when it has no ``crt/host_config.h``
    (``cuda_runtime.h`` includes it; torch 2.15's ``nvidia/cu13`` package does not ship it), the
    first other candidate that has one is added after it.

    Args:
        torch_dir: The installed ``torch`` package directory.
    """
    candidates = _cuda_header_candidates(torch_dir)
    runtime = next((d for d in candidates if (d / "cuda_runtime_api.h").is_file()), None)
    if runtime is None:
        return []
    if (runtime / "crt" / "host_config.h").is_file():
        return [runtime]
    crt = next((d for d in candidates if (d / "crt" / "host_config.h").is_file()), None)
    return [runtime] if crt is None else [runtime, crt]


def cuda_variant_missing() -> str:
    """Why the CUDA variant (record-stream registration) cannot be built here; ``""`` if it can.

    It needs a CUDA build of torch (``torch.version.cuda``), its ``libtorch_cuda.so`` and
    ``c10/cuda`` headers, and CUDA's runtime headers (:func:`cuda_include_dirs`).
    """
    import torch

    torch_dir = Path(torch.__file__).resolve().parent
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    if not (torch_dir / "lib" / "libtorch_cuda.so").is_file():
        return f"torch {torch.__version__} has no {torch_dir / 'lib' / 'libtorch_cuda.so'}"
    macros = torch_dir / "include" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not macros.is_file():
        return f"torch {torch.__version__} ships no c10/cuda headers ({macros})"
    if not cuda_include_dirs(torch_dir):
        looked = ", ".join(str(d) for d in _cuda_header_candidates(torch_dir))
        return (
            f"no CUDA runtime headers (cuda_runtime_api.h) for torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}) in {looked}; set CUDA_HOME to a CUDA toolkit, or "
            f"pip install the CUDA headers of torch's CUDA version (cuda-toolkit[cudart,crt])"
        )
    return ""


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
        whose ``libtorch_cuda.so`` and CUDA runtime headers are present
        (:func:`cuda_variant_missing` says why not).

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
        f"-std={CXX_STANDARD}",
        "-O2",
        "-shared",
        "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{include}",
        f"-I{header_dir}",
    ]
    with_cuda = with_record_stream and not cuda_variant_missing()
    if with_cuda:
        cuda_includes = cuda_include_dirs(torch_dir)
        argv += ["-DWATERWAVE_SHIM_TORCH_CUDA", *(f"-I{d}" for d in cuda_includes)]
    argv += [str(source), "-o", str(output), f"-L{torch_lib}", "-lc10"]
    if with_cuda:
        argv += ["-lc10_cuda", "-ltorch_cuda", "-ltorch_cpu"]
    argv += [
        "-Wl,--no-undefined",  # a missing symbol fails the link with its name, not the load
        f"-Wl,-rpath,{torch_lib}",
        f"-L{lib_dir}",
        f"-l:{library_path().name}",
        f"-Wl,-rpath,{lib_dir}",
    ]
    return argv, with_cuda


def compiler_message(stderr: str) -> str:
    """The compiler's output, shortened to its first and last lines when it is long."""
    text = stderr.strip()
    if len(text) <= _MESSAGE_CHARS:
        return text
    half = _MESSAGE_CHARS // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters ...]\n{text[-half:]}"


@dataclasses.dataclass(frozen=True)
class ShimCompile:
    """One run of the compiler on the shim.

    Attributes:
        argv: The command.
        with_record_stream: Whether it built the CUDA variant (record-stream registration).
        returncode: The compiler's exit status (0: built and linked).
        message: The compiler's output (:func:`compiler_message`), ``""`` when silent.
        seconds: Wall seconds the compiler took.
    """

    argv: list[str]
    with_record_stream: bool
    returncode: int
    message: str
    seconds: float

    @property
    def ok(self) -> bool:
        """The shim was compiled and linked."""
        return self.returncode == 0

    def describe(self) -> str:
        """The command and the compiler's output, for an error message."""
        return f"{' '.join(self.argv)}\n{self.message}"


def compile_shim(output: Path, *, with_record_stream: bool = True) -> ShimCompile:
    """Compiles and links the shim into ``output`` (no cache, no fallback).

    Args:
        output: The shared library to write.
        with_record_stream: Build the CUDA variant where torch is a CUDA build.

    Raises:
        ShimBuildError: No C++ compiler, or torch ships no C++ headers.
    """
    argv, with_cuda = shim_command(output, with_record_stream=with_record_stream)
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ShimCompile(argv, with_cuda, -1, str(exc), time.perf_counter() - start)
    return ShimCompile(
        argv,
        with_cuda,
        done.returncode,
        compiler_message(done.stderr + done.stdout),
        time.perf_counter() - start,
    )


def build_shim(cache_dir: Path | None = None) -> Path:
    """Builds the shim for the torch that runs (once per torch, pool library and source).

    Where torch is a CUDA build, the CUDA variant is built; if that fails, the shim without it
    (the typed OOM still works) and the failure is kept for :func:`record_stream_build_error`.

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
        done = compile_shim(out)
        if not done.ok and done.with_record_stream:
            # The record-stream part needs torch's CUDA headers and libraries to agree with the
            # CUDA headers found; without it the typed OOM still works (said once at run time).
            (target.parent / "record_stream_build_error.txt").write_text(done.describe())
            done = compile_shim(out, with_record_stream=False)
        if not done.ok:
            raise ShimBuildError(f"Building the torch shim failed: {done.describe()}")
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


_warned_lock = threading.Lock()
_warned = False


def _warn_once(text: str) -> None:
    global _warned
    with _warned_lock:
        if _warned:
            return
        _warned = True
    warnings.warn(text, ShimBuildWarning, stacklevel=4)


def shim_for_pool(*, required: bool) -> tuple[TorchShim | None, str]:
    """The shim :func:`~waterwave_hpo.memory.use_pool` hands PyTorch, and why it is incomplete.

    Complete means: built and loaded, and, where torch is a CUDA build, with the record-stream
    registration (its CUDA variant).

    Args:
        required: Raise when the shim is not complete (``memory_pool="on"``). Otherwise an
            incomplete shim is warned about once per process (:class:`ShimBuildWarning`), with
            the compiler's message, and the pool runs with what was built.

    Returns:
        ``(shim, problem)``: the loaded shim, or ``None`` when none could be built; ``problem``
        is ``""`` for a complete shim, else what is missing and the compiler's message.

    Raises:
        ShimBuildError: ``required`` and the shim is not complete.
    """
    import torch

    shim: TorchShim | None = None
    try:
        shim = torch_shim()
    except (ShimBuildError, OSError) as exc:
        problem = (
            f"{exc}\nWithout the shim a pool OOM reaches PyTorch as a RuntimeError "
            "(waterwave_hpo.memory.translate_oom converts it), so PyTorch's own OOM fallbacks "
            "(cuDNN workspace) do not run, and Tensor.record_stream does not reach the pool."
        )
    else:
        problem = ""
        if torch.version.cuda is not None and not shim.has_record_stream:
            why = record_stream_build_error(shim.path) or cuda_variant_missing()
            problem = (
                f"The torch shim was built without its CUDA variant, so Tensor.record_stream "
                f"does not reach the pool (declare cross-stream use with pool.record_stream): "
                f"{why}"
            )
    if problem and required:
        raise ShimBuildError(
            f"{problem}\nRun `waterwave-hpo doctor` to check the shim build; "
            "memory_pool='auto' runs without it."
        )
    if problem:
        _warn_once(
            f"{problem}\nRun `waterwave-hpo doctor` to check the shim build; "
            "memory_pool='on' refuses to run without it."
        )
    return shim, problem
