"""Shared test setup: quiet Optuna, and the ``gpu`` marker skipped where CUDA is absent."""

from __future__ import annotations

import optuna
import pytest
import torch

optuna.logging.set_verbosity(optuna.logging.WARNING)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
