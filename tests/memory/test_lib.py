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


@pytest.mark.slow  # one subprocess importing the package
def test_a_library_others_can_write_is_refused_and_a_private_one_loads(tmp_path: Path) -> None:
    installed = library_path()  # the variable is unset here: the installed library
    private = tmp_path / "lib"
    private.mkdir(mode=0o755)
    copy = private / "libwaterwave_pool.so"
    copy.write_bytes(installed.read_bytes())
    # One process (importing the package takes seconds); the loader is cached, so cleared
    # between the three cases: a private copy, the file writable by others, its directory.
    code = (
        "import os\n"
        "from waterwave_hpo.memory import StreamAwarePool\n"
        "from waterwave_hpo.memory._lib import load_library\n"
        f"lib, directory = {str(copy)!r}, {str(private)!r}\n"
        "for file_mode, dir_mode in ((0o644, 0o755), (0o666, 0o755), (0o644, 0o777)):\n"
        "    os.chmod(lib, file_mode); os.chmod(directory, dir_mode)\n"
        "    load_library.cache_clear()\n"
        "    try:\n"
        "        StreamAwarePool(backend='sim')\n"
        "        print('LOADED')\n"
        "    except ImportError as exc:\n"
        "        print('IMPORT-ERROR', exc)\n"
        "os.chmod(directory, 0o755)\n"
    )
    env = {**os.environ, LIBRARY_ENV_VAR: str(copy)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[0] == "LOADED"
    assert out[1].startswith("IMPORT-ERROR") and "writable by group or others" in out[1]
    assert str(copy) in out[1] and "chmod go-w" in out[1]
    assert out[2].startswith("IMPORT-ERROR") and "its directory is writable" in out[2]
