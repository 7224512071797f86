"""Fused trials: K models of one structure trained as one (HFTA, MLSys 2021, arXiv:2102.02344).

:func:`structure_key` says which models can fuse, :func:`fuse` stacks them into a
:class:`FusedModule` that runs the user's unchanged model under ``torch.func.vmap`` (with fused
kernels for Linear and Conv1d/Conv2d), :func:`per_model_loss` gives each model its own loss.
:func:`optimizer` builds a :class:`FusedOptimizer` whose every hyperparameter is per model;
:class:`PerModelScheduler` and :class:`LambdaLR` give each model its own learning-rate schedule,
:func:`clip_grad_norm_` clips each model's gradients by its own norm. :func:`verify` (or
``fuse(..., example_inputs=...)``) proves a fused module runs batched and matches the K models
before training, or raises a :class:`FusionError` naming the module at fault.
This module only re-exports.
"""

from waterwave_hpo.fusion._clip import clip_grad_norm_
from waterwave_hpo.fusion._dropout import PerModelDropout
from waterwave_hpo.fusion._errors import FusionError
from waterwave_hpo.fusion._fuse import FusedModule
from waterwave_hpo.fusion._fuse import fuse
from waterwave_hpo.fusion._kernels import FusedConv
from waterwave_hpo.fusion._kernels import FusedLinear
from waterwave_hpo.fusion._loss import per_model_loss
from waterwave_hpo.fusion._optim import FusedOptimizer
from waterwave_hpo.fusion._optim import OptimizerKind
from waterwave_hpo.fusion._optim import optimizer
from waterwave_hpo.fusion._schedule import LambdaLR
from waterwave_hpo.fusion._schedule import PerModelScheduler
from waterwave_hpo.fusion._structure import SUPPORTED_LAYERS
from waterwave_hpo.fusion._structure import ModuleEntry
from waterwave_hpo.fusion._structure import StructureKey
from waterwave_hpo.fusion._structure import TensorEntry
from waterwave_hpo.fusion._structure import TensorKind
from waterwave_hpo.fusion._structure import structure_key
from waterwave_hpo.fusion._verify import Verification
from waterwave_hpo.fusion._verify import verify

__all__ = [
    "SUPPORTED_LAYERS",
    "FusedConv",
    "FusedLinear",
    "FusedModule",
    "FusedOptimizer",
    "FusionError",
    "LambdaLR",
    "ModuleEntry",
    "OptimizerKind",
    "PerModelDropout",
    "PerModelScheduler",
    "StructureKey",
    "TensorEntry",
    "TensorKind",
    "Verification",
    "clip_grad_norm_",
    "fuse",
    "optimizer",
    "per_model_loss",
    "structure_key",
    "verify",
]
