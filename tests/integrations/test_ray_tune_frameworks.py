"""shared_gpu() where Ray Tune's callers take resources_per_trial: transformers' Ray backend,
with_shared_gpu as its docstring writes it (a local Ray with one logical GPU)."""

from __future__ import annotations

from pathlib import Path
import subprocess
import sys
from typing import Any

import pytest

ray = pytest.importorskip("ray")
tune = pytest.importorskip("ray.tune")
pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import BertConfig  # noqa: E402
from transformers import BertForSequenceClassification  # noqa: E402
from transformers import Trainer  # noqa: E402
from transformers import TrainingArguments  # noqa: E402
from transformers.trainer_utils import BestRun  # noqa: E402
from waterwave_hpo.integrations import ray_tune as ww_tune  # noqa: E402
from waterwave_hpo.integrations.transformers import SharedGPULease  # noqa: E402

import waterwave_hpo as ww  # noqa: E402

# tests/conftest.py: 1 logical GPU
pytestmark = [pytest.mark.usefixtures("ray_cluster")]


def test_shared_gpu_reads_as_a_resources_per_trial_mapping() -> None:
    resources = ww.shared_gpu(4, cpus_per_trial=0.5)
    assert resources.get("gpu", 0) == 0.25
    assert resources["cpu"] == 0.5
    assert dict(resources) == {"cpu": 0.5, "gpu": 0.25}
    assert "gpu" in resources and resources.get("memory") is None
    assert isinstance(resources, tune.PlacementGroupFactory)


def test_with_shared_gpu_as_its_docstring_writes_it(tmp_path: Path) -> None:
    code = "import waterwave_hpo as ww\nprint(ww.integrations.ray_tune.with_shared_gpu.__name__)\n"
    # A fresh interpreter, outside the checkout (an installed, non-editable package).
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "with_shared_gpu"


def _train(config: dict[str, Any]) -> None:
    stats = ww_tune.lease_stats()
    tune.report({"held": stats.n_held, "x": config["x"]})


def test_tuner_with_shared_gpu_takes_leases() -> None:
    tuner = tune.Tuner(
        ww_tune.with_shared_gpu(_train, trials_per_gpu=2, cpus_per_trial=0.5),
        param_space={"x": tune.grid_search([1, 2])},
    )
    results = tuner.fit()
    assert not results.errors
    assert sorted(r.metrics["x"] for r in results) == [1, 2]
    assert all(r.metrics["held"] >= 1 for r in results)  # the trial held its lease


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, 100, (n, 16), generator=g)
        self.y = self.x[:, 0] % 2

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.y[i]}


def model_init(trial: Any = None) -> BertForSequenceClassification:
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


@pytest.mark.slow
def test_transformers_ray_backend_runs_with_shared_gpu_and_takes_leases(tmp_path: Any) -> None:
    resources = ww.shared_gpu(2, cpus_per_trial=0.5)
    trainer = Trainer(
        model_init=model_init,
        args=TrainingArguments(
            output_dir=str(tmp_path / "out"),
            num_train_epochs=1,
            per_device_train_batch_size=16,
            report_to="none",
            disable_tqdm=True,
            save_strategy="no",
            use_cpu=True,
        ),
        train_dataset=Tokens(32, 0),
        eval_dataset=Tokens(16, 1),
        callbacks=[SharedGPULease(resources)],
    )
    best = trainer.hyperparameter_search(
        hp_space=lambda _: {"learning_rate": tune.grid_search([1e-3, 1e-2])},
        backend="ray",
        n_trials=1,
        resources_per_trial=resources,
        storage_path=str(tmp_path / "ray"),
    )
    assert isinstance(best, BestRun)
    analysis = best.run_summary
    assert [t.status for t in analysis.trials] == ["TERMINATED"] * 2
    node = ray.get_runtime_context().get_node_id()
    stats = ww_tune.lease_stats(gpu_id=0, node_id=node)  # LookupError: no lease was ever taken
    assert stats.n_held == 0  # both given back
