"""Without Ray the cluster API fails on use, with the command that installs it."""

from __future__ import annotations

import sys

import pytest

import waterwave_hpo as ww
from waterwave_hpo.cluster._imports import import_ray


def test_importing_waterwave_hpo_does_not_import_ray() -> None:
    code = "import sys, waterwave_hpo; print('ray' in sys.modules, 'grpc' in sys.modules)"
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    )
    assert out.stdout.split() == ["False", "False"]


def test_missing_ray_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # "import ray" raises ImportError
    with pytest.raises(ImportError, match=r'pip install "waterwave-hpo\[ray\]"'):
        import_ray()
    with pytest.raises(ImportError, match="needs Ray"):
        ww.shared_gpu(2)
    with pytest.raises(ImportError, match="needs Ray"):
        ww.RayExecutor(n_hosts=1)
