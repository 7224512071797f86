"""The bench's workloads: a ResNet-style CNN, a GPT-style language model, the demo's digits NAS.

Each workload has a search space (the same parameter sets are run by every method: they are
drawn once, from a seeded sampler), a model builder, and synthetic or real data made on the
trial's device from a per-trial seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import enum
import functools
from typing import Any

import optuna
import torch
from torch import nn


class Workload(enum.Enum):
    """The models the bench trains."""

    RESNET = "resnet"
    """A ResNet-style CNN on 32x32 RGB images (CIFAR-shaped, synthetic), 10 classes."""
    GPT = "gpt"
    """A GPT-style decoder (causal self-attention) on random token sequences."""
    DIGITS = "digits"
    """The demo's NAS search space on scikit-learn's 8x8 digits (real data)."""


class Setting(enum.Enum):
    """How much memory the trials ask for.

    ``LIGHT``: every trial fits beside the others. ``HIGH``: the paper's high memory demand,
    the co-hosted trials' solo peaks add up to more than the device memory.
    """

    LIGHT = "light"
    HIGH = "high"


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload at one setting, as every method runs it.

    Attributes:
        workload: Which model.
        setting: Light or high memory demand.
        batch_size: Samples per step (images; sequences of ``seq_len`` tokens for GPT).
        steps: Training steps per trial.
        seq_len: Tokens per sequence (GPT only).
    """

    workload: Workload
    setting: Setting
    batch_size: int
    steps: int
    seq_len: int = 64


# -- models --------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """ResNet's basic block, ``[B, C, H, W] -> [B, C, H, W]`` (He et al., CVPR 2016).

    Two 3x3 convolutions with batch norm and a skip connection: the one residual block of the
    project's models, tests and experiments (its skip crosses its inside, so a NodeGroup keeps
    it whole).
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


def build_resnet(trial: optuna.trial.BaseTrial) -> nn.Module:
    """A ResNet-style CNN, ``[B, 3, 32, 32] -> [B, 10]``.

    ``[B, 3, 32, 32] -> [B, 10]``: stem, ``blocks`` residual blocks per stage at widths
    ``width``, ``2 width`` (stride-2 downsampling between), global pooling, linear head.
    """
    width = trial.suggest_categorical("width", [16, 32, 48])
    blocks = trial.suggest_int("blocks", 1, 3)
    layers: list[nn.Module] = [
        nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
    ]
    channels = width
    for stage in range(2):
        if stage:
            layers.append(
                nn.Sequential(
                    nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1, bias=False),
                    nn.BatchNorm2d(2 * channels),
                    nn.ReLU(),
                )
            )
            channels *= 2
        layers += [BasicBlock(channels) for _ in range(blocks)]
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)))
    return nn.Sequential(*layers)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class _Embed(nn.Module):
    def __init__(self, vocab: int, d: int, max_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[:, : idx.shape[1]]  # type: ignore[no-any-return]


GPT_VOCAB = 256


def build_gpt(trial: optuna.trial.BaseTrial, max_len: int = 1024) -> nn.Module:
    """A GPT-style decoder, ``[B, T] int64 tokens -> [B, T, 256]`` logits.

    ``[B, T] int64 tokens -> [B, T, 256]`` logits: embedding, ``layers`` pre-norm decoder
    blocks of width ``d_model`` (4 heads), final norm and head.
    """
    d = trial.suggest_categorical("d_model", [64, 128])
    n_layers = trial.suggest_int("layers", 2, 4)
    return nn.Sequential(
        _Embed(GPT_VOCAB, d, max_len),
        *[_Block(d, 4) for _ in range(n_layers)],
        nn.Sequential(nn.LayerNorm(d), nn.Linear(d, GPT_VOCAB)),
    )


def build_digits(trial: optuna.trial.BaseTrial) -> nn.Module:
    """The demo's CNN (:func:`waterwave_hpo.demo.build_model`), ``[B, 1, 8, 8] -> [B, 10]``."""
    from waterwave_hpo.demo import build_model

    return build_model(trial)  # type: ignore[arg-type]


_BUILDERS: dict[Workload, Callable[[optuna.trial.BaseTrial], nn.Module]] = {
    Workload.RESNET: build_resnet,
    Workload.GPT: build_gpt,
    Workload.DIGITS: build_digits,
}


def build(workload: Workload, params: dict[str, Any]) -> nn.Module:
    """The model of ``workload`` for fixed ``params`` (on the CPU, seeded by the caller)."""
    trial = optuna.trial.FixedTrial(params)
    model = _BUILDERS[workload](trial)
    trial.suggest_float("lr", 1e-4, 1e-2, log=True)
    return model


def draw_params(workload: Workload, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` parameter sets from the workload's search space, seeded.

    ``n`` parameter sets from the workload's search space, drawn by a seeded random
    sampler: every method runs exactly these.

    Raises:
        ValueError: If ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1 (trials to draw).")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    out = []
    for _ in range(n):
        trial = study.ask()
        _BUILDERS[workload](trial)
        trial.suggest_float("lr", 1e-4, 1e-2, log=True)
        out.append(dict(trial.params))
        study.tell(trial, 0.0)
    return out


# -- data ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _digits_cpu() -> tuple[torch.Tensor, torch.Tensor]:
    from waterwave_hpo.demo import load_digits

    d = load_digits()
    return d.x_train, d.y_train


def make_batches(
    spec: WorkloadSpec, device: torch.device, seed: int, n_batches: int = 4
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n_batches`` training batches ``(input, target)`` on ``device``.

    ``n_batches`` training batches ``(input, target)`` on ``device``, cycled by the
    training loop (made once per trial, so data loading is not what is measured).

    Shapes: RESNET ``[B, 3, 32, 32]`` float32 and ``[B]`` int64; GPT ``[B, T]`` and ``[B, T]``
    int64 (next-token targets); DIGITS ``[B, 1, 8, 8]`` and ``[B]`` (real digits, with
    replacement when ``B`` exceeds the 1437 training images).
    """
    g = torch.Generator().manual_seed(seed)
    b = spec.batch_size
    batches = []
    for _ in range(n_batches):
        if spec.workload is Workload.RESNET:
            x = torch.randn(b, 3, 32, 32, generator=g)
            y = torch.randint(0, 10, (b,), generator=g)
        elif spec.workload is Workload.GPT:
            tokens = torch.randint(0, GPT_VOCAB, (b, spec.seq_len + 1), generator=g)
            x, y = tokens[:, :-1], tokens[:, 1:]
        else:
            xs, ys = _digits_cpu()
            idx = torch.randint(0, xs.shape[0], (b,), generator=g)
            x, y = xs[idx], ys[idx]
        batches.append((x.to(device), y.to(device)))
    return batches


def loss_of(spec: WorkloadSpec, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the model's output ``out`` against targets ``y``."""
    if spec.workload is Workload.GPT:
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return nn.functional.cross_entropy(out, y)
