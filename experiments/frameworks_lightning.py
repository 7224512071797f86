"""Example: a Lightning ``Trainer`` per trial, co-hosted by the executor.

An MLP on scikit-learn's bundled digits; each trial builds
``lightning.Trainer(**trainer_kwargs(...))`` (the trial's device, a CSV logger in its own
directory) with optuna-integration's ``PyTorchLightningPruningCallback``::

    python experiments/frameworks_lightning.py --trials 8 --k 4

Needs the ``frameworks`` extra.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import optuna
import torch
from torch import nn


def loaders(seed: int) -> tuple[Any, Any]:
    """Digits as (train, val) loaders; the shuffle has its own generator (see the README)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    data = torch.utils.data.TensorDataset(
        torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    )
    train, val = torch.utils.data.random_split(
        data, [1437, 360], generator=torch.Generator().manual_seed(0)
    )
    return (
        torch.utils.data.DataLoader(
            train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(seed)
        ),
        torch.utils.data.DataLoader(val, batch_size=360),
    )


def main(argv: list[str] | None = None) -> optuna.Study:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--k", type=int, default=4, help="trials at once on the device")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--logs", default=None, help="log root (default: a temporary one)")
    args = parser.parse_args(argv)

    import lightning as L
    from optuna_integration import PyTorchLightningPruningCallback
    from waterwave_hpo.integrations.lightning import trainer_kwargs

    import waterwave_hpo as ww

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
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    root = args.logs or tempfile.mkdtemp(prefix="ww-lightning-")

    def objective(trial: optuna.trial.Trial) -> float:
        model = Digits(
            trial.suggest_float("lr", 1e-3, 0.5, log=True), trial.suggest_int("hidden", 8, 64)
        )
        train, val = loaders(seed=trial.number)
        trainer = L.Trainer(
            **trainer_kwargs(
                root,
                max_epochs=args.epochs,
                log_every_n_steps=5,
                enable_progress_bar=False,
                enable_model_summary=False,
                enable_checkpointing=False,
                callbacks=[PyTorchLightningPruningCallback(trial, monitor="val_acc")],
            )
        )
        trainer.fit(model, train, val)
        return float(trainer.callback_metrics["val_acc"])

    study = optuna.create_study(
        study_name="digits",
        direction="maximize",
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1),
    )
    ww.WaterwaveExecutor(args.device, trials_per_device=args.k).optimize(
        study, objective, n_trials=args.trials
    )
    states = [t.state.name for t in study.trials]
    print(f"best val_acc {study.best_value:.3f} {study.best_params}")
    print({s: states.count(s) for s in sorted(set(states))}, "logs:", f"{root}/digits/trial_<n>")
    return study


if __name__ == "__main__":
    main()
