"""Hugging Face ``Trainer.hyperparameter_search``, run by the :class:`WaterwaveExecutor`.

``trainer.hyperparameter_search(backend="optuna")`` cannot take an executor (its kwargs go to
``optuna.create_study``) and trains one shared ``Trainer`` for every trial: two threads would
train one model. :func:`hyperparameter_search` takes the same arguments and returns the same
``BestRun``, but builds a fresh ``Trainer`` per trial from the one given and lets the executor
run the trials co-hosted (Waterwave, IEEE TC 72(10), 2023: several trainings in one process).

Co-hosted trials are threads of one process, so what accelerate and transformers keep
process-wide is handled here (see the user guide, docs/guide/frameworks.md, "Hugging Face Trainer"):

- ``TrainingArguments(...)`` resets accelerate's ``AcceleratorState`` under running neighbours
  (``AcceleratorState._reset_state()`` in ``training_args.py``): each trial's arguments are
  built with ``accelerator_config={"use_configured_state": True}``, which reuses the state the
  given ``Trainer`` already set up, and never reset it.
- accelerate's ``GradientState`` (gradient sync flag, the active dataloader) is one dict per
  process: it is made one dict per thread, so a trial's gradient accumulation and its
  ``gather_for_metrics`` read its own dataloader, not a neighbour's.
- ``set_seed(args.seed)`` (``Trainer.__init__`` and ``train()``) reseeds Python's, NumPy's and
  torch's global generators, which the neighbours draw from: with more than one trial at a
  time it is skipped in the trials (each such search warns); ``full_determinism=True``
  (process-wide deterministic algorithms) is refused.
- accelerate's ``KwargsHandler.to_kwargs()`` (``Trainer.__init__``, through
  ``GradientState(gradient_accumulation_plugin)``) builds the handler's defaults inside
  ``clear_environment()``: it empties ``os.environ`` for the whole process, then puts back the
  copy it took. Under a neighbour's ``clear_environment`` that copy is empty, and the process
  lost its environment (``PATH`` included) for good. Each handler class's defaults are built
  once per process, under a lock, and reused: no trial empties the environment. Its
  ``is_cuda_available()`` (``Accelerator.free_memory()``, at each ``train()``) sets and pops
  ``PYTORCH_NVML_BASED_CUDA_CHECK`` around torch's check (``patch_environment``): the trials
  take turns there, so no interleaving leaves it set or drops the user's own value.
- ``model_init`` runs one trial at a time (a lock): ``from_pretrained`` patches
  ``torch.nn.init`` and sets torch's default dtype process-wide while it loads.
- accelerate keeps one device per process (``PartialState().device``): trials run on that one
  device (never ``DataParallel``); an executor with several GPUs is refused.

Needs the ``frameworks`` extra (``pip install "waterwave-hpo[frameworks]"``).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
import contextlib
import contextvars
import copy
import dataclasses
import logging
import os
import threading
from typing import Any
import warnings

import optuna

from waterwave_hpo import _checks
from waterwave_hpo.executor import WaterwaveExecutor
from waterwave_hpo.executor import current

try:
    import accelerate.state as _accelerate_state
    import accelerate.utils.dataclasses as _accelerate_dataclasses
    import accelerate.utils.environment as _accelerate_environment
    import accelerate.utils.imports as _accelerate_imports
    import transformers
    import transformers.trainer as _hf_trainer
    from transformers.trainer_callback import TrainerCallback
    from transformers.trainer_utils import BestRun
    from transformers.trainer_utils import default_compute_objective
    from transformers.trainer_utils import default_hp_space_optuna
except ImportError as _error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "waterwave_hpo.integrations.transformers needs transformers and accelerate: "
        f'pip install "waterwave-hpo[frameworks]" ({_error})'
    ) from _error

_logger = logging.getLogger("waterwave_hpo")

_CREATE_STUDY_KWARGS = ("sampler", "pruner", "storage", "study_name", "load_if_exists")
_OPTIMIZE_KWARGS = ("timeout", "callbacks", "gc_after_trial", "catch", "show_progress_bar")

_CO_HOSTED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "waterwave_hpo_hf_co_hosted", default=False
)
"""True in a trial's thread while other trials may run beside it (K > 1)."""

_GUARDS_LOCK = threading.Lock()
_MODEL_INIT_LOCK = threading.Lock()
_HANDLER_DEFAULTS_LOCK = threading.RLock()  # a handler built inside may build another
_PATCH_ENVIRONMENT_LOCK = threading.RLock()
_HANDLER_DEFAULTS: dict[type, dict[str, Any]] = {}
"""Each accelerate ``KwargsHandler`` class's ``to_dict()`` of ``cls()`` in an empty environment."""


def hyperparameter_search(
    trainer: transformers.Trainer,
    hp_space: Callable[[optuna.trial.Trial], dict[str, Any]] | None = None,
    compute_objective: Callable[[dict[str, float]], float | Sequence[float]] | None = None,
    n_trials: int = 20,
    direction: str | Sequence[str] = "minimize",
    *,
    executor: WaterwaveExecutor | None = None,
    study: optuna.Study | None = None,
    **kwargs: Any,
) -> BestRun | list[BestRun]:
    """``trainer.hyperparameter_search(backend="optuna", ...)``, run co-hosted by an executor.

    Each trial gets a fresh ``Trainer`` of ``type(trainer)``: ``trainer.args`` with the values
    ``hp_space(trial)`` returns (cast to the fields' types, as transformers does), its own
    ``output_dir`` (``<output_dir>/run-<trial number>``, transformers' name), and the given
    trainer's ``model_init``, datasets, collator, processing class, ``compute_metrics``,
    ``compute_loss_func``, ``preprocess_logits_for_metrics`` and its own callbacks (a shallow
    copy of each per trial, so counters such as ``EarlyStoppingCallback``'s are per trial).
    The model is built by ``model_init(trial)`` on the trial's device. Each evaluation is
    reported to the trial (``compute_objective(metrics)`` at ``global_step``), and the trial is
    pruned when the study's pruner says so; without an evaluation during training the trial
    evaluates once at the end, as transformers does.

    Args:
        trainer: A ``transformers.Trainer`` (or subclass) built with ``model_init=``; only its
            settings are used, its own model is not trained.
        hp_space: ``hp_space(trial) -> dict`` of ``TrainingArguments`` fields; ``None``:
            transformers' ``default_hp_space_optuna``. Keys that are no field are ignored with a
            warning (``model_init(trial)`` may read them from ``trial.params``).
        compute_objective: ``metrics -> float`` (or floats, multi-objective); ``None``:
            transformers' ``default_compute_objective`` (the evaluation loss, or the sum of the
            metrics).
        n_trials: Trials to run (>= 1).
        direction: ``"minimize"``, ``"maximize"``, or a list of them (multi-objective).
        executor: The :class:`~waterwave_hpo.WaterwaveExecutor` that runs the trials;
            ``None``: ``WaterwaveExecutor()`` (every visible GPU, else the CPU, 4 trials each).
        study: An Optuna study to use (its storage, sampler and pruner); ``None``: a new one,
            made with ``direction`` and the ``optuna.create_study`` kwargs.
        **kwargs: As transformers' optuna backend: ``optuna.create_study`` arguments
            (``sampler``, ``pruner``, ``storage``, ``study_name``, ``load_if_exists``; not with
            ``study=``) and ``Study.optimize`` arguments (``timeout``, ``callbacks``,
            ``gc_after_trial``, ``catch``, ``show_progress_bar``). ``n_jobs`` is refused: the
            executor's ``trials_per_device`` sets the concurrency.

    Returns:
        A ``transformers.trainer_utils.BestRun`` (``run_id`` is the trial number as a string,
        ``objective``, ``hyperparameters``), or a list of them for several directions.

    Raises:
        TypeError: If ``trainer`` is not a ``transformers.Trainer``, ``executor`` not a
            ``WaterwaveExecutor``, ``study`` not an ``optuna.Study``, or a keyword argument is
            unknown.
        ValueError: If ``trainer`` has no ``model_init`` or was given an optimizer,
            ``n_jobs`` is passed, ``study=`` comes with ``create_study`` kwargs or another
            direction, ``full_determinism=True`` with several trials at a time, or the executor
            has several CUDA devices or another device than accelerate's (one per process).
        ValueError: If no trial completed (all pruned or failed): no best run.
        Exception: What ``WaterwaveExecutor.optimize`` raises (an objective's exception not in
            ``catch``, after the running trials ended).
    """
    if not isinstance(trainer, transformers.Trainer):
        raise _checks.type_error(
            "trainer", trainer, "a transformers.Trainer", "pass the Trainer you would search with"
        )
    if trainer.model_init is None:
        raise _checks.value_error(
            "trainer",
            trainer,
            "has no model_init, and every trial needs a fresh model",
            "build it with Trainer(model_init=lambda trial: make_model(), ...)",
        )
    if trainer.optimizer is not None or trainer.lr_scheduler is not None:
        raise _checks.value_error(
            "trainer",
            trainer,
            "was given optimizers=(...), which one model's parameters own",
            "drop optimizers= (set optim / learning_rate in TrainingArguments or hp_space)",
        )
    if "n_jobs" in kwargs:
        raise _checks.value_error(
            "n_jobs",
            kwargs["n_jobs"],
            "cannot be combined with the executor, which runs trials_per_device trials at once",
            "drop n_jobs and pass executor=WaterwaveExecutor(trials_per_device=...)",
        )
    create_kwargs = {k: kwargs.pop(k) for k in _CREATE_STUDY_KWARGS if k in kwargs}
    optimize_kwargs = {k: kwargs.pop(k) for k in _OPTIMIZE_KWARGS if k in kwargs}
    if kwargs:
        name = sorted(kwargs)[0]
        raise _checks.type_error(
            name,
            kwargs[name],
            "a keyword hyperparameter_search knows",
            f"pass only {', '.join(_CREATE_STUDY_KWARGS + _OPTIMIZE_KWARGS)}",
        )
    n_trials = _checks.check_int("n_trials", n_trials, minimum=1)
    directions = [direction] if isinstance(direction, str) else list(direction)
    if executor is None:
        executor = WaterwaveExecutor()
    elif not isinstance(executor, WaterwaveExecutor):
        raise _checks.type_error(
            "executor",
            executor,
            "a waterwave_hpo.WaterwaveExecutor",
            "pass e.g. executor=ww.WaterwaveExecutor(trials_per_device=4)",
        )
    study = _study(study, directions, create_kwargs)
    co_hosted = executor.auto_trials or executor.trials_per_device > 1 or len(executor.devices) > 1
    if co_hosted and trainer.args.full_determinism:
        raise _checks.value_error(
            "trainer.args.full_determinism",
            True,
            "makes every trial call torch.use_deterministic_algorithms(True) and set "
            "CUBLAS_WORKSPACE_CONFIG, process-wide, under the co-hosted neighbours",
            "set full_determinism=False, or run one trial at a time "
            "(WaterwaveExecutor(trials_per_device=1))",
        )
    _check_device(executor)
    _install_guards()
    if co_hosted:
        warnings.warn(
            "Co-hosted trials skip transformers' set_seed(args.seed): it reseeds the process's "
            "global generators (random, NumPy, torch), which the trials running beside it draw "
            "from. Results are not bit-reproducible with several trials at a time; see the "
            "user guide's page docs/guide/reproducibility.md.",
            UserWarning,
            stacklevel=2,
        )
    run = _TrialRun(
        template=trainer,
        hp_space=default_hp_space_optuna if hp_space is None else hp_space,
        compute_objective=(
            default_compute_objective if compute_objective is None else compute_objective
        ),
        co_hosted=co_hosted,
    )
    executor.optimize(study, run, n_trials=n_trials, **optimize_kwargs)
    finished = study.get_trials(deepcopy=False)
    if not any(t.state == optuna.trial.TrialState.COMPLETE for t in finished):
        states = sorted({t.state.name for t in finished})
        raise ValueError(
            f"No trial of study {study.study_name!r} completed (states: {states}), so there is "
            "no best run; read study.trials (e.g. every trial pruned), or run more trials."
        )
    if len(study.directions) == 1:
        best = study.best_trial
        return BestRun(str(best.number), best.value, best.params)
    return [BestRun(str(t.number), t.values, t.params) for t in study.best_trials]


def _study(
    study: optuna.Study | None, directions: list[str], create_kwargs: dict[str, Any]
) -> optuna.Study:
    """The study to run: ``study`` checked against ``directions``, or a new one."""
    if study is None:
        if len(directions) == 1:
            return optuna.create_study(direction=directions[0], **create_kwargs)
        return optuna.create_study(directions=directions, **create_kwargs)
    if not isinstance(study, optuna.Study):
        raise _checks.type_error(
            "study", study, "an optuna.Study", "create one with optuna.create_study(...)"
        )
    if create_kwargs:
        name = sorted(create_kwargs)[0]
        raise _checks.value_error(
            name,
            create_kwargs[name],
            "is an optuna.create_study argument, but study= is given",
            f"create the study with {name}=... and pass only study=",
        )
    wanted = [optuna.study.StudyDirection[d.upper()] for d in directions]
    if list(study.directions) != wanted:
        raise _checks.value_error(
            "direction",
            directions[0] if len(directions) == 1 else directions,
            f"differs from the study's directions {[d.name.lower() for d in study.directions]}",
            "pass the study's direction, or another study",
        )
    return study


def _check_device(executor: WaterwaveExecutor) -> None:
    """Refuse devices accelerate cannot give each trial (one device per process)."""
    devices = list(executor.devices)
    if len(devices) > 1 and any(d.type == "cuda" for d in devices):
        raise _checks.value_error(
            "executor.devices",
            [str(d) for d in devices],
            "has several GPUs, but accelerate keeps one device per process "
            "(PartialState().device), so the Trainers of one process cannot each train on "
            "their own GPU",
            "run one process per GPU (CUDA_VISIBLE_DEVICES=N and "
            "WaterwaveExecutor(devices='cuda:0')), or trainer.hyperparameter_search("
            "backend='ray', resources_per_trial=ww.shared_gpu(...))",
        )
    state = _accelerate_state.PartialState()
    if state.device is None or _same_device(state.device, devices[0]):
        return
    raise _checks.value_error(
        "executor.devices",
        [str(d) for d in devices],
        f"is not accelerate's device for this process ({state.device}), which every "
        "Trainer of the process uses",
        f"pass WaterwaveExecutor(devices={str(state.device)!r}), or start the process with "
        "CUDA_VISIBLE_DEVICES set to the GPU you want",
    )


def _same_device(a: Any, b: Any) -> bool:
    import torch

    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    return (a.index or 0) == (b.index or 0)


class _PerThreadDict:
    """A descriptor giving each thread its own dict: accelerate's ``GradientState`` per trial.

    accelerate keeps ``GradientState`` as a Borg (every instance shares one class-level dict,
    ``accelerate/state.py``): a trial's ``sync_gradients`` flag and active dataloader would be
    its neighbours'. The thread that installs it keeps the dict it had.
    """

    def __init__(self, first: dict[str, Any]) -> None:
        self._local = threading.local()
        self._local.state = first
        self.first = first

    def reset_own(self) -> None:
        """Empty the calling thread's dict, unless it is the installing thread's own."""
        state = self._state()
        if state is not self.first:
            state.clear()

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] | None = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = {}
        return state

    def __get__(self, obj: object, objtype: type | None = None) -> dict[str, Any]:
        return self._state()

    def __set__(self, obj: object, value: dict[str, Any]) -> None:
        self._local.state = value


def _reset_gradient_state() -> None:
    descriptor = vars(_accelerate_state.GradientState).get("_shared_state")
    if isinstance(descriptor, _PerThreadDict):
        descriptor.reset_own()


def _install_guards() -> None:
    """Make accelerate's and transformers' process-wide state safe for co-hosted trials.

    Idempotent. Outside a co-hosted trial everything behaves as before: ``set_seed`` reseeds,
    ``GradientState`` is the calling thread's (the installing thread keeps the one it had).
    Also sets up accelerate's process state once, here in the caller's thread, so that no
    trial initializes it while another reads it.
    """
    with _GUARDS_LOCK:
        gradient_state = _accelerate_state.GradientState
        if not isinstance(vars(gradient_state).get("_shared_state"), _PerThreadDict):
            gradient_state._shared_state = _PerThreadDict(gradient_state._shared_state)
        if not getattr(_hf_trainer.set_seed, "_waterwave_guard", False):
            _hf_trainer.set_seed = _guard_set_seed(_hf_trainer.set_seed)
            _hf_trainer.enable_full_determinism = _guard_full_determinism(
                _hf_trainer.enable_full_determinism
            )
        handler = _accelerate_dataclasses.KwargsHandler
        if not getattr(handler.to_kwargs, "_waterwave_guard", False):
            handler.to_kwargs = _guard_to_kwargs(handler.to_kwargs)
        if not getattr(_accelerate_imports.patch_environment, "_waterwave_guard", False):
            _accelerate_imports.patch_environment = _guard_patch_environment(
                _accelerate_imports.patch_environment
            )
        # The one every Trainer builds, here before the trials start: none empties the
        # environment then (another handler class's defaults are built once, under the lock).
        _handler_defaults(_accelerate_dataclasses.GradientAccumulationPlugin)
        if not _accelerate_state.PartialState().initialized:
            _accelerate_state.PartialState()


def _handler_defaults(cls: type) -> dict[str, Any]:
    """``cls().to_dict()`` as accelerate builds it, in an empty environment.

    Built once per process and class, under a lock (accelerate's ``clear_environment``); the
    same dict after (read, never changed).
    """
    with _HANDLER_DEFAULTS_LOCK:
        defaults = _HANDLER_DEFAULTS.get(cls)
        if defaults is None:
            with _accelerate_environment.clear_environment():
                defaults = cls().to_dict()
            _HANDLER_DEFAULTS[cls] = defaults
        return defaults


def _guard_to_kwargs(original: Callable[[Any], dict[str, Any]]) -> Callable[[Any], dict[str, Any]]:
    """``KwargsHandler.to_kwargs`` of accelerate 1.x (``utils/dataclasses.py``), made safe.

    The fields that differ from the class's defaults, with the defaults from
    :func:`_handler_defaults` instead of a ``cls()`` built inside ``clear_environment()`` at
    every call. ``original`` stays reachable as ``__wrapped__``.
    """

    def to_kwargs(self: Any) -> dict[str, Any]:
        defaults = _handler_defaults(type(self))
        return {k: v for k, v in self.to_dict().items() if defaults[k] != v}

    to_kwargs._waterwave_guard = True  # type: ignore[attr-defined]
    to_kwargs.__wrapped__ = original  # type: ignore[attr-defined]
    return to_kwargs


def _guard_patch_environment(
    original: Callable[..., contextlib.AbstractContextManager[None]],
) -> Callable[..., contextlib.AbstractContextManager[None]]:
    """Accelerate's ``patch_environment``, one thread at a time.

    It sets its keys, then restores or pops them: two interleaved calls leave the first one's
    value behind (or drop the user's own).
    """

    @contextlib.contextmanager
    def patch_environment(**kwargs: Any) -> Iterator[None]:
        with _PATCH_ENVIRONMENT_LOCK, original(**kwargs):
            yield

    patch_environment._waterwave_guard = True  # type: ignore[attr-defined]
    patch_environment.__wrapped__ = original  # type: ignore[attr-defined]
    return patch_environment


def _guard_set_seed(original: Callable[..., None]) -> Callable[..., None]:
    def set_seed(seed: int, *args: Any, **kwargs: Any) -> None:
        if _CO_HOSTED.get():
            return  # reseeding the global generators would change the neighbours' streams
        original(seed, *args, **kwargs)

    set_seed._waterwave_guard = True  # type: ignore[attr-defined]
    return set_seed


def _guard_full_determinism(original: Callable[..., None]) -> Callable[..., None]:
    def enable_full_determinism(seed: int, *args: Any, **kwargs: Any) -> None:
        if _CO_HOSTED.get():
            raise _checks.value_error(
                "full_determinism",
                True,
                "calls torch.use_deterministic_algorithms(True) and sets "
                "CUBLAS_WORKSPACE_CONFIG process-wide, under the co-hosted neighbours",
                "keep full_determinism=False in hp_space and TrainingArguments, or run one "
                "trial at a time (trials_per_device=1)",
            )
        original(seed, *args, **kwargs)

    return enable_full_determinism


class _ReportToTrial(TrainerCallback):  # type: ignore[misc]
    """Reports each evaluation's objective to the Optuna trial and prunes when told to."""

    def __init__(
        self, trial: optuna.trial.Trial, compute_objective: Callable[[dict[str, float]], Any]
    ) -> None:
        self.trial = trial
        self.compute_objective = compute_objective
        self.objective: Any = None

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        metrics = kwargs.get("metrics")
        if metrics is None:
            return
        self.objective = self.compute_objective(dict(metrics))
        if len(self.trial.study.directions) != 1:
            return  # Optuna cannot report intermediate values of several objectives
        self.trial.report(float(self.objective), state.global_step)
        if self.trial.should_prune():
            raise optuna.TrialPruned(f"pruned at step {state.global_step}")


@dataclasses.dataclass(frozen=True)
class _TrialRun:
    """The objective: one fresh ``Trainer`` per trial, built from ``template``."""

    template: transformers.Trainer
    hp_space: Callable[[optuna.trial.Trial], dict[str, Any]]
    compute_objective: Callable[[dict[str, float]], Any]
    co_hosted: bool

    def __call__(self, trial: optuna.trial.Trial) -> Any:
        token = _CO_HOSTED.set(self.co_hosted)
        _reset_gradient_state()  # this thread's: nothing left of a previous trial
        try:
            trainer = self._trainer(trial)
            report = next(
                cb
                for cb in trainer.callback_handler.callbacks
                if isinstance(cb, _ReportToTrial) and cb.trial is trial
            )
            trainer.train(trial=trial)
            objective = report.objective
            if objective is None:
                objective = self.compute_objective(trainer.evaluate())
            trainer.model = trainer.model_wrapped = None
            return objective
        finally:
            _reset_gradient_state()
            _CO_HOSTED.reset(token)

    def _trainer(self, trial: optuna.trial.Trial) -> transformers.Trainer:
        template = self.template
        args = _trial_args(template.args, self.hp_space(trial), trial.number)
        device = current().device
        if not _same_device(args.device, device):
            raise RuntimeError(
                f"The trial's TrainingArguments resolved device {args.device}, not the trial's "
                f"device {device}; accelerate's PartialState was set up for another device. "
                "Build the Trainer and run the search in one process on one device."
            )
        args._n_gpu = 1 if device.type == "cuda" else 0  # never DataParallel over every GPU
        callbacks = [copy.copy(cb) for cb in _user_callbacks(template)]
        callbacks.append(_ReportToTrial(trial, self.compute_objective))
        return type(template)(
            model=None,
            args=args,
            data_collator=template.data_collator,
            train_dataset=template.train_dataset,
            eval_dataset=template.eval_dataset,
            processing_class=template.processing_class,
            model_init=_locked_model_init(template.model_init),
            compute_loss_func=template.compute_loss_func,
            compute_metrics=template.compute_metrics,
            callbacks=callbacks,
            preprocess_logits_for_metrics=template.preprocess_logits_for_metrics,
        )


def _trial_args(template_args: Any, params: dict[str, Any], number: int) -> Any:
    """``template_args`` with the trial's values and own ``output_dir``; accelerate's state kept."""
    fields = {f.name for f in dataclasses.fields(template_args) if f.init}
    values: dict[str, Any] = {}
    for key, value in params.items():
        if key not in fields:
            _logger.warning(
                "hp_space returned %r, which is no TrainingArguments field; ignored (as "
                "transformers does). model_init(trial) can read it from trial.params.",
                key,
            )
            continue
        old = getattr(template_args, key, None)
        values[key] = type(old)(value) if old is not None else value
    if template_args.data_seed is None and "data_seed" not in values:
        # The data order then follows args.seed as with transformers' own set_seed (accelerate's
        # seedable sampler falls back to torch.initial_seed(), which set_seed sets), even where
        # set_seed is skipped under co-hosting: the sampler has its own generator.
        values["data_seed"] = template_args.seed
    config = template_args.accelerator_config
    config = dict(dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config or {})
    # TrainingArguments(...) otherwise resets accelerate's AcceleratorState under the
    # running neighbours (AcceleratorState._reset_state() in training_args.py).
    config["use_configured_state"] = True
    values["accelerator_config"] = config
    root = template_args.output_dir or "trainer_output"
    values["output_dir"] = os.path.join(root, f"run-{number}")
    return dataclasses.replace(template_args, **values)


def _user_callbacks(template: transformers.Trainer) -> list[Any]:
    """The callbacks the user added: not the defaults every Trainer builds itself."""
    from transformers.integrations import get_reporting_integration_callbacks
    from transformers.trainer_callback import DefaultFlowCallback
    from transformers.trainer_callback import PrinterCallback
    from transformers.trainer_callback import ProgressCallback

    defaults = (
        DefaultFlowCallback,
        PrinterCallback,
        ProgressCallback,
        _ReportToTrial,
        *get_reporting_integration_callbacks(template.args.report_to),
    )
    return [cb for cb in template.callback_handler.callbacks if not isinstance(cb, defaults)]


def _locked_model_init(model_init: Callable[..., Any]) -> Callable[..., Any]:
    """``model_init`` run one trial at a time, with the arity transformers checks."""
    import inspect

    if len(inspect.signature(model_init).parameters) == 0:

        def init0() -> Any:
            with _MODEL_INIT_LOCK:
                return model_init()

        return init0

    def init1(trial: Any) -> Any:
        with _MODEL_INIT_LOCK:
            return model_init(trial)

    return init1


class SharedGPULease(TrainerCallback):  # type: ignore[misc]
    """Holds a :func:`waterwave_hpo.shared_gpu` memory lease while a ``Trainer`` trains.

    transformers' Ray backend (``trainer.hyperparameter_search(backend="ray",
    resources_per_trial=ww.shared_gpu(...))``) runs its own trainable, which
    ``SharedGPU.wrap`` cannot wrap: without this callback its trials are packed on the GPUs but
    take no lease, so co-placed trials' peaks are not kept apart. Add it to the ``Trainer``
    (``trainer.add_callback(SharedGPULease(resources))``): every trial then waits for its
    lease at ``on_train_begin`` and gives it back at ``on_train_end``. A trial that raises
    skips ``on_train_end``; its lease expires ``lease_ttl_s`` after its process stops.

    Args:
        resources: The :class:`~waterwave_hpo.integrations.ray_tune.SharedGPU` given as
            ``resources_per_trial``.
        nbytes: Bytes to lease (> 0), or ``None``: the request's ``memory_per_trial_bytes``.
    """

    def __init__(self, resources: Any, nbytes: int | None = None) -> None:
        """Keep the resource request; the lease is taken when training begins."""
        self.resources = resources
        self.nbytes = nbytes
        self._held: Any = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the held lease (Ray sends the Trainer to its workers)."""
        state = self.__dict__.copy()
        state["_held"] = None  # a lease belongs to the process that took it
        return state

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Wait for the lease (see ``SharedGPU.lease``)."""
        if self._held is None:
            held = self.resources.lease(self.nbytes)
            held.__enter__()
            self._held = held

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Give the lease back."""
        held, self._held = self._held, None
        if held is not None:
            held.__exit__(None, None, None)


__all__ = ["SharedGPULease", "hyperparameter_search"]
