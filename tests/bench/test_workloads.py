"""Workloads: the same trials for every method, models of the documented shapes."""

from __future__ import annotations

from pathlib import Path
import subprocess
import sys

import pytest
import torch

from waterwave_hpo.bench import Setting
from waterwave_hpo.bench import Workload
from waterwave_hpo.bench import WorkloadSpec
from waterwave_hpo.bench import draw_params
from waterwave_hpo.bench._workloads import build
from waterwave_hpo.bench._workloads import loss_of
from waterwave_hpo.bench._workloads import make_batches


@pytest.mark.parametrize("workload", list(Workload))
def test_params_are_drawn_the_same_every_time(workload: Workload) -> None:
    a = draw_params(workload, 4, seed=3)
    assert a == draw_params(workload, 4, seed=3)
    assert a != draw_params(workload, 4, seed=4)
    assert all("lr" in p for p in a)


@pytest.mark.parametrize(
    ("workload", "out_shape"),
    [(Workload.RESNET, (3, 10)), (Workload.GPT, (3, 16, 256)), (Workload.DIGITS, (3, 10))],
)
def test_models_train_on_their_batches(workload: Workload, out_shape: tuple[int, ...]) -> None:
    spec = WorkloadSpec(workload, Setting.LIGHT, batch_size=3, steps=1, seq_len=16)
    model = build(workload, draw_params(workload, 1, seed=0)[0])
    batches = make_batches(spec, torch.device("cpu"), seed=0, n_batches=2)
    assert len(batches) == 2
    x, y = batches[0]
    out = model(x)
    assert tuple(out.shape) == out_shape
    loss = loss_of(spec, out, y)
    loss.backward()
    assert torch.isfinite(loss)


def test_draw_params_rejects_zero() -> None:
    with pytest.raises(ValueError, match="n=0"):
        draw_params(Workload.GPT, 0, seed=0)


def test_the_models_import_and_train_without_pandas(tmp_path: Path) -> None:
    # The GPU benchmark script imports the bench's models on machines that may lack pandas;
    # only the functions that build tables need it. Run from an empty folder: `python -c` puts
    # the working directory first on sys.path, and the checkout must not stand in for the
    # installed package.
    check = (
        "import sys\n"
        "sys.modules['pandas'] = None\n"
        "import optuna, torch\n"
        "from waterwave_hpo.bench import BasicBlock, build_resnet, results_table\n"
        "model = build_resnet(optuna.trial.FixedTrial({'width': 16, 'blocks': 1}))\n"
        "assert any(isinstance(m, BasicBlock) for m in model.modules())\n"
        "print(tuple(model(torch.randn(2, 3, 16, 16)).shape))\n"
        "try:\n"
        "    results_table([])\n"
        "except ImportError as e:\n"
        "    print('tables:', e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(2, 10)" in proc.stdout
    assert "tables: import of pandas halted" in proc.stdout
