"""The framework examples in experiments/ run (few trials) and end without a FAIL."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from optuna.trial import TrialState
import pytest

pytest.importorskip("transformers")
pytest.importorskip("lightning")
pytest.importorskip("optuna_integration")

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_transformers_example_runs(tmp_path: Path) -> None:
    study = _load("frameworks_transformers").main(
        ["--trials", "4", "--k", "2", "--out", str(tmp_path)]
    )
    assert len(study.trials) == 4
    assert TrialState.FAIL not in [t.state for t in study.trials]


@pytest.mark.slow
def test_lightning_example_runs(tmp_path: Path) -> None:
    study = _load("frameworks_lightning").main(
        ["--trials", "4", "--k", "2", "--epochs", "2", "--logs", str(tmp_path)]
    )
    assert TrialState.FAIL not in [t.state for t in study.trials]
    assert sorted(p.name for p in (tmp_path / "digits").iterdir()) == [
        f"trial_{n}" for n in range(4)
    ]
