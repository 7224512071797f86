"""The installed package: its public names, and a clear error when imported from the checkout."""

from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys

import waterwave_hpo as ww

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_public_api_is_exported() -> None:
    for name in (
        "WaterwaveExecutor",
        "create_study",
        "load_study",
        "current",
        "pipeline",
        "node_groups",
        "PipelineScheduler",
        "RayExecutor",
        "shared_gpu",
    ):
        assert name in ww.__all__, name
        assert getattr(ww, name) is not None


def test_importing_the_source_checkout_says_how_to_fix_it(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", "import waterwave_hpo"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "source checkout" in result.stderr
    assert "pip install ." in result.stderr
