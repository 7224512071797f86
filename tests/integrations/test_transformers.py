"""waterwave_hpo.integrations.transformers: Trainer searches co-hosted by the executor."""

from __future__ import annotations

from collections.abc import Callable
import os
import threading
from typing import Any

import optuna
from optuna.trial import TrialState
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState
from accelerate.utils.dataclasses import GradientAccumulationPlugin
from accelerate.utils.dataclasses import KwargsHandler
from accelerate.utils.dataclasses import TorchDynamoPlugin
import torch
from transformers import BertConfig
from transformers import BertForSequenceClassification
from transformers import Trainer
from transformers import TrainerCallback
from transformers import TrainingArguments
from transformers.trainer_utils import BestRun
from waterwave_hpo.integrations.transformers import hyperparameter_search

import waterwave_hpo as ww

CONFIG = BertConfig(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=32,
    num_labels=2,
)


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
    return BertForSequenceClassification(CONFIG)


def make_trainer(tmp_path: Any, callbacks: list[Any] | None = None, **args: Any) -> Trainer:
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "num_train_epochs": 2,
        "per_device_train_batch_size": 16,
        "eval_strategy": "steps",
        "eval_steps": 4,
        "report_to": "none",
        "disable_tqdm": True,
        "save_strategy": "no",
        "use_cpu": True,
    }
    settings.update(args)
    return Trainer(
        model_init=model_init,
        args=TrainingArguments(**settings),
        train_dataset=Tokens(64, 0),
        eval_dataset=Tokens(32, 1),
        callbacks=callbacks,
    )


def hp_space(trial: optuna.trial.Trial) -> dict[str, Any]:
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True)}


class Meet(TrainerCallback):  # type: ignore[misc]
    """The first two trials to start training wait for each other: proof that they overlap."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=120)
        self.lock = threading.Lock()
        self.arrivals = [0]
        self.seen: list[dict[str, Any]] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self.lock:
            self.arrivals[0] += 1
            first_two = self.arrivals[0] <= 2
            self.seen.append(
                {
                    "output_dir": args.output_dir,
                    "learning_rate": args.learning_rate,
                    "device": str(args.device),
                    "n_gpu": args.n_gpu,
                    "gradient_state": id(kwargs["optimizer"].gradient_state.__dict__)
                    if kwargs.get("optimizer") is not None
                    else None,
                }
            )
        if first_two:
            self.barrier.wait()  # raises BrokenBarrierError (the trial FAILs) if alone


def executor(k: int = 4) -> ww.WaterwaveExecutor:
    return ww.WaterwaveExecutor("cpu", trials_per_device=k)


@pytest.mark.slow
def test_repeated_k4_searches_end_without_fail_and_trials_overlap(tmp_path: Any) -> None:
    for run in range(3):
        meet = Meet()
        study = optuna.create_study()
        with pytest.warns(UserWarning, match="set_seed") if run == 0 else _nothing():
            best = hyperparameter_search(
                make_trainer(tmp_path / str(run), callbacks=[meet]),
                hp_space,
                n_trials=8,
                executor=executor(),
                study=study,
                catch=(),
            )
        states = [t.state for t in study.trials]
        assert len(states) == 8
        assert TrialState.FAIL not in states, [t.system_attrs for t in study.trials]
        assert set(states) <= {TrialState.COMPLETE, TrialState.PRUNED}
        assert isinstance(best, BestRun)
        assert best.run_id == str(study.best_trial.number)
        assert best.objective == study.best_value
        assert best.hyperparameters == study.best_params
        assert meet.barrier.n_waiting == 0 and not meet.barrier.broken
        # One Trainer per trial: its own output_dir, the trial's learning rate, one device.
        dirs = sorted(s["output_dir"] for s in meet.seen)
        assert dirs == sorted(str(tmp_path / str(run) / "out" / f"run-{n}") for n in range(8))
        by_dir = {s["output_dir"]: s for s in meet.seen}
        for trial in study.trials:
            seen = by_dir[str(tmp_path / str(run) / "out" / f"run-{trial.number}")]
            assert seen["learning_rate"] == trial.params["learning_rate"]
            assert seen["device"] == "cpu" and seen["n_gpu"] == 0


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def _calls_from_trial_threads(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[str]:
    """Record calls of ``owner.name`` made from threads other than this one."""
    calls: list[str] = []
    original: Callable[..., Any] = getattr(owner, name)
    main = threading.get_ident()

    def spy(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != main:
            calls.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


def test_plain_training_arguments_reset_accelerate_state_so_the_spy_can_see_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    resets = _calls_from_trial_threads(monkeypatch, AcceleratorState, "_reset_state")
    thread = threading.Thread(
        target=lambda: TrainingArguments(output_dir=str(tmp_path), use_cpu=True).device
    )
    thread.start()
    thread.join()
    assert len(resets) == 1  # what the helper's trials must never do under a neighbour


@pytest.mark.slow
def test_trials_neither_reset_accelerate_nor_reseed_nor_share_gradient_state(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    resets = _calls_from_trial_threads(monkeypatch, AcceleratorState, "_reset_state")
    reseeds = _calls_from_trial_threads(monkeypatch, torch, "manual_seed")
    meet = Meet()
    study = optuna.create_study()
    hyperparameter_search(
        make_trainer(tmp_path, callbacks=[meet]),
        hp_space,
        n_trials=4,
        executor=executor(),
        study=study,
    )
    assert [t.state for t in study.trials].count(TrialState.FAIL) == 0
    assert resets == []
    assert reseeds == []
    # The two trials that met at the barrier trained at once, each with its own GradientState.
    first_two = meet.seen[:2]
    assert first_two[0]["gradient_state"] != first_two[1]["gradient_state"]


def test_no_trial_empties_the_process_environment_under_its_neighbours(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Every ``Trainer`` ran accelerate's ``clear_environment()`` (``GradientState``'s
    ``to_kwargs``): two trials building theirs at once left the process without ``PATH``
    (CI: a later test's g++ could not find ``ld``). No trial may delete a key the user set,
    even for a moment, and the search leaves the environment as it found it."""
    deleted: list[tuple[str, str]] = []
    environ_type = type(os.environ)
    original = environ_type.__delitem__
    main = threading.get_ident()

    def spy(self: Any, key: str) -> None:
        if threading.get_ident() != main:
            deleted.append((threading.current_thread().name, key))
        original(self, key)

    monkeypatch.setattr(environ_type, "__delitem__", spy)
    before = dict(os.environ)
    study = optuna.create_study()
    hyperparameter_search(
        make_trainer(tmp_path, num_train_epochs=1),
        hp_space,
        n_trials=4,
        executor=executor(),
        study=study,
    )
    assert [t.state for t in study.trials].count(TrialState.FAIL) == 0
    assert [(name, key) for name, key in deleted if key in before] == []
    assert dict(os.environ) == before


def test_the_guarded_to_kwargs_answers_as_accelerates(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """After a search, each accelerate handler's kwargs are still what accelerate's own
    ``to_kwargs`` says (its defaults built once in an empty environment), under the user's
    environment too."""
    hyperparameter_search(
        make_trainer(tmp_path, num_train_epochs=1, max_steps=1),
        hp_space,
        n_trials=1,
        executor=executor(1),
    )
    guarded = KwargsHandler.to_kwargs
    accelerates = getattr(guarded, "__wrapped__", None)
    assert accelerates is not None, "the search installs the guard"
    cases: list[tuple[Callable[[], Any], dict[str, str], dict[str, Any]]] = [
        (lambda: GradientAccumulationPlugin(num_steps=4), {}, {"num_steps": 4}),
        (lambda: GradientAccumulationPlugin(), {}, {}),
        (lambda: TorchDynamoPlugin(mode="max-autotune"), {}, {"mode": "max-autotune"}),
        (
            TorchDynamoPlugin,
            {"ACCELERATE_DYNAMO_MODE": "reduce-overhead"},
            {"mode": "reduce-overhead"},
        ),
    ]
    for make, env, expected in cases:
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            handler = make()
            assert handler.to_kwargs() == accelerates(handler) == expected, (make, env)


def test_one_trial_at_a_time_keeps_transformers_seeding(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    reseeds = _calls_from_trial_threads(monkeypatch, torch, "manual_seed")
    study = optuna.create_study()
    hyperparameter_search(
        make_trainer(tmp_path, num_train_epochs=1),
        hp_space,
        n_trials=2,
        executor=executor(1),
        study=study,
    )
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    assert len(reseeds) >= 2  # set_seed(args.seed) ran in each trial, as in transformers


def test_each_evaluation_is_reported_and_the_pruner_prunes(tmp_path: Any) -> None:
    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=0.0))
    with pytest.raises(ValueError, match=r"No trial of study .* completed .*PRUNED"):
        hyperparameter_search(
            make_trainer(tmp_path), hp_space, n_trials=4, executor=executor(), study=study
        )
    assert [t.state for t in study.trials] == [TrialState.PRUNED] * 4
    assert all(list(t.intermediate_values) == [4] for t in study.trials)


def test_multi_objective_returns_a_best_run_per_pareto_trial(tmp_path: Any) -> None:
    best = hyperparameter_search(
        make_trainer(tmp_path, num_train_epochs=1),
        hp_space,
        compute_objective=lambda m: (m["eval_loss"], -m["eval_loss"]),
        n_trials=2,
        direction=["minimize", "maximize"],
        executor=executor(2),
    )
    assert isinstance(best, list) and best and all(isinstance(b, BestRun) for b in best)


def test_refusals_name_the_argument_and_the_fix(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path)
    with pytest.raises(ValueError, match="n_jobs=4: cannot be combined with the executor"):
        hyperparameter_search(trainer, n_trials=1, n_jobs=4)
    with pytest.raises(TypeError, match="bogus=1"):
        hyperparameter_search(trainer, n_trials=1, bogus=1)
    with pytest.raises(ValueError, match="direction='maximize': differs from the study"):
        hyperparameter_search(trainer, direction="maximize", study=optuna.create_study())
    with pytest.raises(ValueError, match=r"sampler=.*study= is given"):
        hyperparameter_search(
            trainer, study=optuna.create_study(), sampler=optuna.samplers.RandomSampler()
        )
    no_init = Trainer(
        model=model_init(), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    )
    with pytest.raises(ValueError, match="has no model_init"):
        hyperparameter_search(no_init, n_trials=1, executor=executor())
    deterministic = make_trainer(tmp_path, full_determinism=True)
    with pytest.raises(ValueError, match="full_determinism=True: makes every trial"):
        hyperparameter_search(deterministic, n_trials=1, executor=executor())


def test_several_gpus_are_refused_with_the_alternative(tmp_path: Any) -> None:
    two_gpus = executor()
    two_gpus.devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    study = optuna.create_study()
    with pytest.raises(ValueError, match=r"has several GPUs.*CUDA_VISIBLE_DEVICES.*backend='ray'"):
        hyperparameter_search(make_trainer(tmp_path), n_trials=1, executor=two_gpus, study=study)
    assert study.trials == []


def test_a_study_with_a_journal_storage_is_used_as_it_is(tmp_path: Any) -> None:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(tmp_path / "journal.log")))
    study = optuna.create_study(study_name="hf", storage=storage, direction="minimize")
    best = hyperparameter_search(
        make_trainer(tmp_path, num_train_epochs=1),
        hp_space,
        n_trials=2,
        executor=executor(2),
        study=study,
    )
    reloaded = optuna.load_study(study_name="hf", storage=storage)
    assert [t.state for t in reloaded.trials] == [TrialState.COMPLETE] * 2
    assert best.run_id == str(reloaded.best_trial.number)
    assert all(list(t.intermediate_values) == [4] for t in reloaded.trials)  # 64/16 steps


def test_a_device_other_than_accelerates_is_refused(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path)  # accelerate's process device: the CPU (use_cpu=True)
    on_gpu = executor()
    on_gpu.devices = [torch.device("cuda", 0)]
    with pytest.raises(ValueError, match=r"is not accelerate's device for this process \(cpu\)"):
        hyperparameter_search(trainer, n_trials=1, executor=on_gpu, study=optuna.create_study())


def test_the_given_trainer_still_trains_and_evaluates_after_a_search(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path, num_train_epochs=1)
    hyperparameter_search(trainer, hp_space, n_trials=2, executor=executor(2))
    assert "eval_loss" in trainer.evaluate()
    assert trainer.train().global_step == 4
