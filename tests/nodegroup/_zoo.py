"""Small models for the NodeGroup tests (CPU, seconds) and a trial-context helper."""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import math

import torch
from torch import nn

from waterwave_hpo.bench import BasicBlock
from waterwave_hpo.executor import trial_scope
from waterwave_hpo.scheduler import PipelineScheduler


@contextlib.contextmanager
def in_trial(scheduler: PipelineScheduler | None, trial_number: int = 0) -> Iterator[None]:
    """Run the body as trial ``trial_number`` of ``scheduler``, as the executor would."""
    with trial_scope(scheduler, trial_number):
        yield


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(12, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Dropout(0.1),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 3),
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 5),
    )


class ResNet(nn.Module):
    def __init__(self, c: int = 8, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList(BasicBlock(c) for _ in range(blocks))
        self.head = nn.Linear(c, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=(2, 3)))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """GPT-style: token + position embeddings, pre-LN blocks, tied head."""

    def __init__(
        self, vocab: int = 50, d: int = 32, heads: int = 4, layers: int = 3, ctx: int = 16
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(TransformerBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def batch_for(name: str, n: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input, target)`` for model ``name``; shapes: mlp [n, 12], cnn/resnet [n, 3, 8, 8],
    gpt [n, 16] token ids."""
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g)
    if name in ("cnn", "resnet"):
        k = 5 if name == "cnn" else 4
        return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, k, (n,), generator=g)
    idx = torch.randint(0, 50, (n, 16), generator=g)
    return idx, torch.randint(0, 50, (n, 16), generator=g)


def build(name: str) -> nn.Module:
    return {"mlp": mlp, "cnn": cnn, "resnet": ResNet, "gpt": TinyGPT}[name]()


def loss_of(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "gpt":
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return nn.functional.cross_entropy(out, target)


MODELS = ("mlp", "cnn", "resnet", "gpt")
