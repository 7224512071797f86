"""The demo's search space: a small CNN whose architecture and training the trial chooses."""

from __future__ import annotations

import math
from typing import Any

import optuna
import torch
from torch import nn

from waterwave_hpo import _checks


def build_model(trial: optuna.trial.Trial, generator: torch.Generator | None = None) -> nn.Module:
    """Build the CNN the trial's parameters describe.

    Architecture parameters (NAS): ``n_conv`` (1-3 conv blocks), ``channels_i`` (8-64),
    ``kernel_i`` (3 or 5), ``hidden`` (width of the fully connected layer) and ``dropout``.
    Each conv block is conv (same padding) -> batch norm -> ReLU, followed by 2x2 max pooling in
    the first two blocks, so the 8x8 input shrinks to at most 2x2.

    Args:
        trial: The Optuna trial whose ``suggest_*`` calls choose the architecture.
        generator: Seeds the weight initialization and the dropout masks (a
            :class:`SeededDropout` seeded from it), so that a trial's training does not depend on
            what co-hosted trials draw from torch's global generator. ``None``: torch's default
            initialization and ``nn.Dropout``.

    Returns:
        A module mapping ``[B, 1, 8, 8]`` images to ``[B, 10]`` logits, on the CPU.
    """
    n_conv = trial.suggest_int("n_conv", 1, 3)
    layers: list[nn.Module] = []
    in_channels, size = 1, 8
    for i in range(n_conv):
        out_channels = trial.suggest_categorical(f"channels_{i}", [8, 16, 32, 64])
        kernel = trial.suggest_categorical(f"kernel_{i}", [3, 5])
        layers += [
            nn.Conv2d(in_channels, out_channels, kernel, padding=kernel // 2),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(),
        ]
        if i < 2:
            layers.append(nn.MaxPool2d(2))
            size //= 2
        in_channels = out_channels
    hidden = trial.suggest_categorical("hidden", [32, 64, 128])
    dropout = trial.suggest_float("dropout", 0.0, 0.5)
    layers += [
        nn.Flatten(),
        nn.Linear(in_channels * size * size, hidden),
        nn.ReLU(),
        nn.Dropout(dropout) if generator is None else SeededDropout(dropout, generator),
        nn.Linear(hidden, 10),
    ]
    model = nn.Sequential(*layers)
    if generator is not None:
        _init_(model, generator)
    return model


class SeededDropout(nn.Module):
    """``nn.Dropout`` whose masks come from the module's own generator, not torch's global one.

    ``nn.functional.dropout`` takes no generator; co-hosted trials share the global generator, so
    their masks would depend on each other's timing. The mask generator lives on the input's
    device (created on first use) and is seeded from ``generator`` when the module is built.

    Args:
        p: Probability of zeroing an element, in [0, 1).
        generator: A CPU generator the mask generator's seed is drawn from.

    Raises:
        ValueError: If ``p`` is not in [0, 1).
    """

    def __init__(self, p: float, generator: torch.Generator) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise _checks.value_error("p", p, "must be in [0, 1)", "pass e.g. p=0.1")
        self.p = p
        self.seed = int(torch.randint(2**62, (1,), generator=generator).item())
        self._masks: torch.Generator | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Zero each element of ``x`` (any shape) with probability ``p`` in training mode."""
        if not self.training or self.p == 0.0:
            return x
        if self._masks is None or self._masks.device != x.device:
            self._masks = torch.Generator(device=x.device).manual_seed(self.seed)
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=self._masks)
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, seed={self.seed}"


def _init_(model: nn.Module, generator: torch.Generator) -> None:
    # torch's default initialization of Conv2d/Linear, drawn from `generator`.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=generator)
                if module.bias is not None:
                    fan_in = module.weight[0].numel()
                    bound = 1.0 / math.sqrt(fan_in)
                    module.bias.uniform_(-bound, bound, generator=generator)


def suggest_optimizer(
    trial: optuna.trial.Trial,
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer the trial chooses: ``optimizer`` (adam, adamw, sgd) and ``lr`` (log scale).

    Returns:
        The optimizer class and its arguments (``lr``; SGD also ``momentum=0.9``).
    """
    name = trial.suggest_categorical("optimizer", ["adam", "adamw", "sgd"])
    lr = trial.suggest_float("lr", 1e-4, 3e-2, log=True)
    if name == "sgd":
        return torch.optim.SGD, {"lr": lr, "momentum": 0.9}
    if name == "adamw":
        return torch.optim.AdamW, {"lr": lr}
    return torch.optim.Adam, {"lr": lr}


def build_optimizer(
    trial: optuna.trial.Trial, parameters: list[nn.Parameter]
) -> torch.optim.Optimizer:
    """The optimizer :func:`suggest_optimizer` chooses, over ``parameters``."""
    cls, arguments = suggest_optimizer(trial)
    return cls(parameters, **arguments)


def suggest_batch_size(trial: optuna.trial.Trial) -> int:
    """The trial's training images per step: ``batch_size``, one of 32, 64 or 128."""
    return int(trial.suggest_categorical("batch_size", [32, 64, 128]))
