"""Lightning ``Trainer`` keyword arguments for a trial co-hosted by the executor.

A Lightning ``Trainer`` per trial, inside an objective run by
:class:`~waterwave_hpo.WaterwaveExecutor`: ``lightning.Trainer(**trainer_kwargs(max_epochs=3))``
trains on the trial's device and logs to the trial's own directory. Co-hosted trials are
threads of one process (Waterwave, IEEE TC 72(10), 2023), so what Lightning does process-wide is
handled here (see the user guide, docs/guide/frameworks.md, "Lightning"):

- Lightning's default logger picks ``version_N`` by listing the log directory, so concurrent
  trials wrote into one ``version_0`` (and tensorboardX raised ``FileExistsError``): the logger
  given here writes to ``<root_dir>/<study name>/trial_<number>``, named before it is created.
- ``CUDAAccelerator.setup()`` and ``teardown()`` call ``torch._C._cuda_clearCublasWorkspaces()``
  and ``torch.cuda.empty_cache()`` at every trial's start and end, under the neighbours'
  running kernels: the accelerator given here (:class:`CoHostedCUDAAccelerator`) does neither.
- ``seed_everything`` reseeds the process's generators, which every trial draws from: called
  inside a trial run by the executor it raises (importing this module guards Lightning's public
  ``seed_everything`` names; a reference bound by ``from lightning import seed_everything``
  before that import is not guarded). ``deterministic=`` and ``benchmark=`` set torch flags
  process-wide and are refused with more than one trial at a time.

Needs the ``frameworks`` extra (``pip install "waterwave-hpo[frameworks]"``).
"""

from __future__ import annotations

from collections.abc import Callable
import os
import threading
from typing import Any

from waterwave_hpo import _checks
from waterwave_hpo.executor import current
from waterwave_hpo.executor import current_or_none

try:
    import lightning  # noqa: F401  (the package whose names are guarded)
    from lightning.pytorch.accelerators import CUDAAccelerator
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.loggers import TensorBoardLogger
except ImportError as _error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "waterwave_hpo.integrations.lightning needs Lightning: "
        f'pip install "waterwave-hpo[frameworks]" ({_error})'
    ) from _error

_PROCESS_WIDE = ("deterministic", "benchmark")
_OURS = ("accelerator", "devices", "logger", "default_root_dir", "strategy", "num_nodes")
_GUARD_LOCK = threading.Lock()


class CoHostedCUDAAccelerator(CUDAAccelerator):  # type: ignore[misc]
    """Lightning's CUDA accelerator without its process-wide clean-ups.

    ``CUDAAccelerator.setup()`` and ``teardown()`` (``lightning/pytorch/accelerators/cuda.py``)
    call ``torch._C._cuda_clearCublasWorkspaces()`` and ``torch.cuda.empty_cache()``, which act
    on every stream and trial of the process; they only give memory back early, so a co-hosted
    trial skips them (the executor's pool reuses freed memory across trials anyway).
    ``setup_device`` is Lightning's: ``torch.cuda.set_device``, which is per thread.
    """

    def setup(self, trainer: Any) -> None:
        """Nothing process-wide: no cuBLAS workspace clearing, no ``empty_cache``."""

    def teardown(self) -> None:
        """Nothing process-wide: no cuBLAS workspace clearing, no ``empty_cache``."""


def trainer_kwargs(
    root_dir: str | os.PathLike[str] = "lightning_logs",
    *,
    logger: str = "csv",
    co_hosted: bool = True,
    **overrides: Any,
) -> dict[str, Any]:
    """The ``lightning.Trainer`` keyword arguments for the trial running in this thread.

    Call it inside an objective run by the executor::

        def objective(trial):
            trainer = L.Trainer(**ww_lightning.trainer_kwargs(max_epochs=5),
                                callbacks=[PyTorchLightningPruningCallback(trial, "val_acc")])
            trainer.fit(model, train_loader, val_loader)

    Returns ``accelerator`` and ``devices`` for the trial's device (the CPU:
    ``accelerator="cpu", devices=1``; ``cuda:N``: a :class:`CoHostedCUDAAccelerator` and
    ``devices=[N]``), a ``logger`` writing to ``<root_dir>/<study name>/trial_<number>``,
    ``default_root_dir`` (checkpoints) the same directory, plus ``overrides``.

    Args:
        root_dir: Where the trials' directories go (default ``lightning_logs``, as Lightning).
        logger: ``"csv"`` (``CSVLogger``: ``metrics.csv``) or ``"tensorboard"``
            (``TensorBoardLogger``).
        co_hosted: ``True`` (default) when other trials may run beside this one (the
            executor's ``trials_per_device > 1`` or several devices): ``deterministic`` and
            ``benchmark`` are refused. ``False`` for one trial at a time.
        **overrides: Other ``lightning.Trainer`` arguments, returned with the rest
            (``max_epochs``, ``callbacks``, ...).

    Returns:
        The keyword arguments, a new dict per call.

    Raises:
        waterwave_hpo.NotInTrialError: Outside a trial run by the executor.
        ValueError: If ``logger`` is unknown, an override sets what this function sets
            (``accelerator``, ``devices``, ``logger``, ``default_root_dir``, ``strategy``,
            ``num_nodes``), or, with ``co_hosted``, ``deterministic`` or ``benchmark``
            (process-wide torch flags).
    """
    context = current()
    _install_seed_guard()
    if logger not in ("csv", "tensorboard"):
        raise _checks.value_error(
            "logger", logger, "is not a logger kind", "pass 'csv' or 'tensorboard'"
        )
    for name in _OURS:
        if name in overrides:
            raise _checks.value_error(
                name,
                overrides[name],
                "is set by trainer_kwargs() for the trial's device and directory",
                f"drop {name}=, or build the Trainer's arguments yourself",
            )
    if co_hosted:
        for name in _PROCESS_WIDE:
            if overrides.get(name) is not None:
                raise _checks.value_error(
                    name,
                    overrides[name],
                    "sets torch flags process-wide (torch.use_deterministic_algorithms, "
                    "cudnn.benchmark, CUBLAS_WORKSPACE_CONFIG), under the co-hosted neighbours",
                    f"drop {name}=, or run one trial at a time and pass co_hosted=False",
                )
    name = _study_name(context.trial)
    version = f"trial_{context.trial_number}"
    log_cls = CSVLogger if logger == "csv" else TensorBoardLogger
    trial_logger = log_cls(save_dir=os.fspath(root_dir), name=name, version=version)
    kwargs: dict[str, Any] = dict(overrides)
    kwargs["logger"] = trial_logger
    kwargs["default_root_dir"] = trial_logger.log_dir
    device = context.device
    if device.type == "cuda":
        kwargs["accelerator"] = CoHostedCUDAAccelerator()
        kwargs["devices"] = [device.index or 0]
    else:
        kwargs["accelerator"] = "cpu"
        kwargs["devices"] = 1
    return kwargs


def _study_name(trial: Any) -> str:
    try:
        return str(trial.study.study_name)
    except AttributeError:  # a Ray Tune trial co-hosted by tune_hosts() has no Optuna study
        return "tune"


def _guard_seed_everything(original: Callable[..., int]) -> Callable[..., int]:
    def seed_everything(*args: Any, **kwargs: Any) -> int:
        if current_or_none() is not None:
            raise RuntimeError(
                "seed_everything() was called inside a trial run by WaterwaveExecutor: it "
                "reseeds Python's, NumPy's and torch's global generators, which every trial of "
                "this process draws from, so it would change the neighbours' random streams. "
                "Seed what the trial owns instead: DataLoader(..., generator=torch.Generator()"
                ".manual_seed(seed)) for the data order, and build the model under "
                "torch.random.fork_rng() (see the user guide, docs/guide/reproducibility.md); "
                "or call seed_everything once before the search."
            )
        return original(*args, **kwargs)

    seed_everything._waterwave_guard = True  # type: ignore[attr-defined]
    return seed_everything


def _install_seed_guard() -> None:
    """Guard ``seed_everything`` in every Lightning module that re-exports it (idempotent)."""
    import sys

    import lightning.fabric.utilities.seed as fabric_seed

    with _GUARD_LOCK:
        original = fabric_seed.seed_everything
        if getattr(original, "_waterwave_guard", False):
            return
        guarded = _guard_seed_everything(original)
        for module_name, module in list(sys.modules.items()):
            if module_name.split(".")[0] not in ("lightning", "pytorch_lightning"):
                continue
            if getattr(module, "seed_everything", None) is original:
                module.seed_everything = guarded


_install_seed_guard()

__all__ = ["CoHostedCUDAAccelerator", "trainer_kwargs"]
