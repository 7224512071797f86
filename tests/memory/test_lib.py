"""The loader of the C++ core: a missing library is a clear error naming the file and the fix."""

from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys

import pytest

from waterwave_hpo.memory import LIBRARY_ENV_VAR
from waterwave_hpo.memory import library_path


def test_missing_library_error_names_file_and_fix(tmp_path: Path) -> None:
    missing = tmp_path / "libwaterwave_pool.so"
    code = (
        "from waterwave_hpo.memory import StreamAwarePool\n"
        "try:\n"
        "    StreamAwarePool(backend='sim')\n"
        "except ImportError as exc:\n"
        "    print('IMPORT-ERROR', exc)\n"
    )
    env = {**os.environ, LIBRARY_ENV_VAR: str(missing)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,  # not the source tree, which has no built library
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "IMPORT-ERROR" in out
    assert str(missing) in out
    assert "pip install ." in out


def test_library_path_honours_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LIBRARY_ENV_VAR, "/x/y/libwaterwave_pool.so")
    assert library_path() == Path("/x/y/libwaterwave_pool.so")
    monkeypatch.delenv(LIBRARY_ENV_VAR)
    assert library_path().parent.name == "_lib"
    assert library_path().parent.parent.name == "waterwave_hpo"
