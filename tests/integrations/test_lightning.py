"""waterwave_hpo.integrations.lightning: a Lightning Trainer per co-hosted trial."""

from __future__ import annotations

import csv
from pathlib import Path
import threading
from typing import Any

import optuna
from optuna.trial import TrialState
import pytest

pytest.importorskip("lightning")
pytest.importorskip("optuna_integration")

from fakes.cuda_init import FakeCuda
import lightning as L
from optuna_integration import PyTorchLightningPruningCallback
import torch
from torch import nn
from waterwave_hpo.integrations import lightning as ww_lightning

import waterwave_hpo as ww
from waterwave_hpo.executor import trial_scope


class Digits(L.LightningModule):
    def __init__(self, lr: float, hidden: int) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loaders() -> tuple[Any, Any]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x[:512] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[:512])
    data = torch.utils.data.TensorDataset(x, y)
    train, val = torch.utils.data.random_split(data, [384, 128], torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(0)
    return (
        torch.utils.data.DataLoader(train, batch_size=64, shuffle=True, generator=generator),
        torch.utils.data.DataLoader(val, batch_size=128),
    )


def make_objective(root: Path, meet: threading.Barrier | None = None) -> Any:
    arrivals = [0]
    lock = threading.Lock()

    def objective(trial: optuna.trial.Trial) -> float:
        model = Digits(
            trial.suggest_float("lr", 1e-3, 1.0, log=True), trial.suggest_int("h", 8, 32)
        )
        train, val = loaders()
        trainer = L.Trainer(
            **ww_lightning.trainer_kwargs(
                root,
                max_epochs=3,
                enable_progress_bar=False,
                enable_model_summary=False,
                enable_checkpointing=False,
                callbacks=[PyTorchLightningPruningCallback(trial, monitor="val_acc")],
            )
        )
        with lock:
            arrivals[0] += 1
            first_two = arrivals[0] <= 2
        if meet is not None and first_two:
            meet.wait()  # the first two trials train at once (BrokenBarrierError if alone)
        trainer.fit(model, train, val)
        return float(trainer.callback_metrics["val_acc"])

    return objective


@pytest.mark.slow
def test_k4_one_log_directory_per_trial_each_with_its_own_metrics(tmp_path: Path) -> None:
    meet = threading.Barrier(2, timeout=120)
    study = optuna.create_study(
        study_name="digits", direction="maximize", pruner=optuna.pruners.MedianPruner(0, 1)
    )
    ww.WaterwaveExecutor("cpu", trials_per_device=4).optimize(
        study, make_objective(tmp_path, meet), n_trials=8
    )
    states = [t.state for t in study.trials]
    assert TrialState.FAIL not in states
    assert set(states) <= {TrialState.COMPLETE, TrialState.PRUNED}
    assert not meet.broken
    dirs = sorted(p.name for p in (tmp_path / "digits").iterdir())
    assert dirs == sorted(f"trial_{n}" for n in range(8))
    for trial in study.trials:
        with open(tmp_path / "digits" / f"trial_{trial.number}" / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("val_acc")]
        # Each trial's file holds its own epochs: one val_acc per validation it ran, and
        # the values the pruning callback reported to its trial.
        reported = [trial.intermediate_values[e] for e in sorted(trial.intermediate_values)]
        assert [float(r["val_acc"]) for r in rows] == pytest.approx(reported)
        assert [int(r["epoch"]) for r in rows] == sorted(trial.intermediate_values)


def test_trainer_kwargs_outside_a_trial_names_the_fix() -> None:
    with pytest.raises(ww.NotInTrialError, match="outside a trial"):
        ww_lightning.trainer_kwargs()


def test_process_wide_flags_and_seed_everything_are_refused_in_a_trial(tmp_path: Path) -> None:
    with trial_scope(None, 3, device="cpu"):
        with pytest.raises(ValueError, match="deterministic=True: sets torch flags process-wide"):
            ww_lightning.trainer_kwargs(tmp_path, deterministic=True)
        with pytest.raises(ValueError, match="benchmark=False: sets torch flags"):
            ww_lightning.trainer_kwargs(tmp_path, benchmark=False)
        with pytest.raises(ValueError, match="logger='wandb'"):
            ww_lightning.trainer_kwargs(tmp_path, logger="wandb")
        with pytest.raises(ValueError, match="devices=2: is set by trainer_kwargs"):
            ww_lightning.trainer_kwargs(tmp_path, devices=2)
        assert ww_lightning.trainer_kwargs(tmp_path, co_hosted=False, deterministic=True)[
            "deterministic"
        ]
        state = torch.random.get_rng_state()
        for seed_everything in (L.seed_everything, L.pytorch.seed_everything):
            with pytest.raises(RuntimeError, match="reseeds Python's, NumPy's and torch's"):
                seed_everything(0)
        assert torch.equal(torch.random.get_rng_state(), state)
    assert L.seed_everything(7) == 7  # outside a trial it is Lightning's


def test_on_a_gpu_the_trial_gets_its_device_and_no_process_wide_cleanup(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    FakeCuda(n=2).install(monkeypatch)
    calls: list[str] = []
    monkeypatch.setattr(
        torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear_cublas"), raising=False
    )
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    with trial_scope(None, 5, device="cuda:1"):
        kwargs = ww_lightning.trainer_kwargs(tmp_path)
    assert kwargs["devices"] == [1]
    accelerator = kwargs["accelerator"]
    assert isinstance(accelerator, ww_lightning.CoHostedCUDAAccelerator)
    assert Path(kwargs["default_root_dir"]) == tmp_path / "tune" / "trial_5"
    # Lightning takes them: one device, the trial's, with the co-hosted accelerator.
    trainer = L.Trainer(**kwargs)
    assert trainer.strategy.root_device == torch.device("cuda", 1)
    assert trainer.accelerator is accelerator
    accelerator.setup(trainer=None)
    accelerator.teardown()
    assert calls == []
    # Lightning's own accelerator clears both at setup and teardown, under the neighbours:
    from lightning.pytorch.accelerators import CUDAAccelerator

    CUDAAccelerator().teardown()
    assert calls == ["clear_cublas", "empty_cache"]
