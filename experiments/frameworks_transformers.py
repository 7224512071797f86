"""Example: a Hugging Face ``Trainer`` search co-hosted by the executor.

A tiny BERT built from a config (nothing downloaded) learns a parity label of synthetic token
ids; :func:`waterwave_hpo.integrations.transformers.hyperparameter_search` runs ``--trials``
trials, ``--k`` at a time on one device, each with its own ``Trainer``, evaluations reported
for pruning::

    python experiments/frameworks_transformers.py --trials 8 --k 4

Needs the ``frameworks`` extra.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import optuna
import torch


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``n`` sequences of 16 random token ids; the label is the first id's parity."""

    def __init__(self, n: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 100, (n, 16), generator=generator)
        self.labels = self.ids[:, 0] % 2

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main(argv: list[str] | None = None) -> optuna.Study:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--k", type=int, default=4, help="trials at once on the device")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="output_dir (default: a temporary one)")
    args = parser.parse_args(argv)

    from transformers import BertConfig
    from transformers import BertForSequenceClassification
    from transformers import Trainer
    from transformers import TrainingArguments
    from waterwave_hpo.integrations.transformers import hyperparameter_search

    import waterwave_hpo as ww

    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
    )

    def model_init(trial: Any = None) -> BertForSequenceClassification:
        return BertForSequenceClassification(config)

    def hp_space(trial: optuna.trial.Trial) -> dict[str, Any]:
        return {
            "learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True),
            "weight_decay": trial.suggest_float("weight_decay", 0.0, 0.1),
        }

    out = args.out or tempfile.mkdtemp(prefix="ww-hf-")
    trainer = Trainer(
        model_init=model_init,
        args=TrainingArguments(
            output_dir=out,
            num_train_epochs=3,
            per_device_train_batch_size=16,
            eval_strategy="epoch",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=args.device == "cpu",
        ),
        train_dataset=Tokens(128, 0),
        eval_dataset=Tokens(64, 1),
    )
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=2))
    best = hyperparameter_search(
        trainer,
        hp_space,
        n_trials=args.trials,
        executor=ww.WaterwaveExecutor(args.device, trials_per_device=args.k),
        study=study,
    )
    counts = {s.name: 0 for s in optuna.trial.TrialState}
    for trial in study.trials:
        counts[trial.state.name] += 1
    print(f"best run {best.run_id}: eval_loss {best.objective:.4f} {best.hyperparameters}")
    print({k: v for k, v in counts.items() if v}, "output_dir:", out)
    return study


if __name__ == "__main__":
    main()
