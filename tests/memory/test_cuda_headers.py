"""The pool's dlopen'ed CUDA driver signatures match the real cuda.h.

Configures ``allocator_ext`` with ``-DWATERWAVE_CHECK_CUDA_H=ON`` and builds the compile-time
check ``tests/cuda_h_check.cpp`` (``static_assert`` on ``decltype`` of every driver function the
``cuda`` upstream loads). Needs cmake, a C++ compiler and a CUDA toolkit's ``cuda.h``; skips with
the reason where one is missing. No GPU is used.
"""

from __future__ import annotations

import os
from pathlib import Path
import shutil
import subprocess

import pytest

ALLOCATOR_EXT = Path(__file__).resolve().parents[2] / "allocator_ext"


def _cuda_include_dir() -> Path | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda.h").is_file():
            return Path(home) / "include"
    return None


def test_driver_function_types_match_cuda_h(tmp_path: Path) -> None:
    include = _cuda_include_dir()
    if include is None:
        pytest.skip("no CUDA toolkit cuda.h (CUDA_HOME, CUDA_PATH, /usr/local/cuda/include)")
    if shutil.which("cmake") is None or (shutil.which("g++") or shutil.which("c++")) is None:
        pytest.skip("cmake and a C++ compiler are needed to compile the cuda.h check")
    configure = subprocess.run(
        [
            "cmake",
            "-S",
            str(ALLOCATOR_EXT),
            "-B",
            str(tmp_path),
            "-DWATERWAVE_CHECK_CUDA_H=ON",
            f"-DWATERWAVE_CUDA_INCLUDE_DIR={include}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert configure.returncode == 0, configure.stdout[-2000:] + configure.stderr[-2000:]
    build = subprocess.run(
        ["cmake", "--build", str(tmp_path), "--target", "cuda_h_check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
