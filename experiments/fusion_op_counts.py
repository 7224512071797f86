"""ATen operations (~ GPU kernel launches) of one fused training step against K steps.

On a GPU a small model's step is bound by kernel launches, one per ATen operation; fusion pays
when a fused step of K models runs about as many operations as one model's step. For K = 1, 2, 4,
8, 16 and four models (the digits MLP 64-128-128-10 and the small digits CNN of
bench_fusion_kernels.py at batch 64; timm's resnet18 at 32x32, batch 8, with each fused
convolution in the form this machine picks per layer, and as ``resnet18_grouped`` with every
one grouped, as CUDA runs it; a 2-layer BERT from a config, width 64, 16 tokens, batch 8) it
counts, with a TorchDispatchMode (waterwave_hpo/bench/_opcount.py), the operations of:

* ``separate``: K ordinary models, one step each (forward, cross-entropy, backward, SGD step
  with ``foreach=True``);
* ``fused``: ``fusion.fuse(models)``, one step: forward, one flat cross-entropy over the K*B
  rows (times K: the sum of the K mean losses), backward, one SGD step over the stacked
  parameters;
* ``fused_pml``: the same with ``fusion.per_model_loss`` (a loop over the K losses);
* ``fused_opt``: the fused step with ``fusion.optimizer`` (each model its own learning rate,
  as the K separate optimizers have): what a search's fused trials run.

``--optimizer adamw`` uses ``torch.optim.AdamW`` (``foreach=True``) for every method instead of
SGD. The ratio quoted in the docs is fused ops / one model's (separate ops / K), with views
(which launch no kernel) and without them (``*_compute_ops``).

It also times the separate and the fused step (CPU wall-clock, median of ``--reps``, the ratio
separate/fused: how many times faster K models train fused), with the load average. Run::

    python experiments/fusion_op_counts.py --reps 3
    python experiments/fusion_op_counts.py --models bert --ks 1 4 8
    python experiments/fusion_op_counts.py --models bert --ks 1 4 8 --optimizer adamw

Writes results.json and README.md to ``--out``
(default ``experiments/results/<date>-fusion-op-counts/``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import datetime as dt
import json
import os
from pathlib import Path
import platform
import statistics
import sys
import time
from typing import Any
import warnings

import torch
from torch import nn
import torch.nn.functional as F

from waterwave_hpo import fusion
from waterwave_hpo.bench import count_ops
from waterwave_hpo.bench import import_timm

KS = (1, 2, 4, 8, 16)


def digits_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 2 * 2, 64),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(64, 10),
    )


def resnet18() -> nn.Module:
    return import_timm().create_model("resnet18", pretrained=False, num_classes=10)  # type: ignore[no-any-return]


class BertLogits(nn.Module):
    """BERT for sequence classification returning its logits (a tensor, for one loss code)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers as hf

        config = hf.BertConfig(
            vocab_size=128,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            num_labels=10,
        )
        self.bert = hf.BertForSequenceClassification(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids).logits  # type: ignore[no-any-return]


def inputs(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if name == "digits_mlp":
        return torch.randn(64, 64, generator=g)
    if name == "small_cnn":
        return torch.randn(64, 1, 8, 8, generator=g)
    if name.startswith("resnet18"):
        return torch.randn(8, 3, 32, 32, generator=g)
    return torch.randint(0, 128, (8, 16), generator=g)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "digits_mlp": digits_mlp,
    "small_cnn": small_cnn,
    "resnet18": resnet18,
    "resnet18_grouped": resnet18,
    "bert": BertLogits,
}
# Every fused convolution grouped (what CUDA runs), not the CPU's form chosen per layer.
GROUPED = {"resnet18_grouped"}


OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adamw": torch.optim.AdamW,
}


def steps(name: str, k: int, optimizer: str = "sgd") -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    models = [MODELS[name]().train() for _ in range(k)]
    x = inputs(name)
    y = torch.randint(0, 10, (x.shape[0],), generator=torch.Generator().manual_seed(1))
    cls = OPTIMIZERS[optimizer]
    base_lr = 0.01 if optimizer == "sgd" else 1e-3
    lrs = [base_lr * (1 + i / 10) for i in range(k)]  # a search: each model its own
    opts = [cls(m.parameters(), lr=lr, foreach=True) for m, lr in zip(models, lrs, strict=True)]

    def separate() -> None:
        for model, opt in zip(models, opts, strict=True):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

    fused = fusion.fuse(models)
    if name in GROUPED:
        for module in fused.modules():
            if isinstance(module, fusion.FusedConv):
                module.autotune = False
    fused_opt = cls(fused.parameters(), lr=base_lr, foreach=True)
    per_model_opt = fusion.optimizer(cls, fused, [{"lr": lr} for lr in lrs])
    flat_y = y.repeat(k)

    def fused_step() -> None:
        fused_opt.zero_grad(set_to_none=True)
        out = fused(x)
        (F.cross_entropy(out.flatten(0, 1), flat_y) * k).backward()
        fused_opt.step()

    def fused_pml() -> None:
        fused_opt.zero_grad(set_to_none=True)
        fusion.per_model_loss(F.cross_entropy, fused(x), y).sum().backward()
        fused_opt.step()

    def fused_per_model_opt() -> None:
        per_model_opt.zero_grad(set_to_none=True)
        out = fused(x)
        (F.cross_entropy(out.flatten(0, 1), flat_y) * k).backward()
        per_model_opt.step()

    return {
        "separate": separate,
        "fused": fused_step,
        "fused_pml": fused_pml,
        "fused_opt": fused_per_model_opt,
    }


def median_time(step: Callable[[], None], reps: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ks", type=int, nargs="*", default=list(KS))
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="sgd")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path("experiments/results") / f"{dt.date.today()}-fusion-op-counts"
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    rows: list[dict[str, Any]] = []
    for name in args.models:
        for k in args.ks:
            work = steps(name, k, args.optimizer)
            for run in work.values():
                run()  # warm-up: lazy state (optimizer buffers, caches) before counting
            counts = {method: count_ops(run) for method, run in work.items()}
            load = os.getloadavg()[0]
            sep_s = median_time(work["separate"], args.reps)
            fused_s = median_time(work["fused"], args.reps)
            row = {
                "model": name,
                "k": k,
                **{f"{m}_ops": c.total for m, c in counts.items()},
                **{f"{m}_compute_ops": c.compute for m, c in counts.items()},
                **{f"{m}_by_op": dict(sorted(c.by_op.items())) for m, c in counts.items()},
                "separate_s": sep_s,
                "fused_s": fused_s,
                "speedup": sep_s / fused_s,
                "loadavg_1min": load,
            }
            rows.append(row)
            print(
                json.dumps({n: v for n, v in row.items() if not n.endswith("_by_op")}), flush=True
            )
    machine = {
        "machine": f"{platform.machine()} VM, {os.cpu_count()} cores, CPU only",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": args.threads,
        "optimizer": args.optimizer,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    (out / "results.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    (out / "README.md").write_text(render(machine, rows))
    print(f"wrote {out}/results.json and README.md")


def render(machine: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    def ratio(row: dict[str, Any], method: str, kind: str = "") -> str:
        one = row[f"separate{kind}_ops"] / row["k"]
        return f"{row[f'{method}{kind}_ops'] / one:.2f}x"

    lines = [
        "# ATen operations of one training step: fused vs K separate",
        "",
        f"Machine: {machine['machine']}; Python {machine['python']}, torch {machine['torch']}, "
        f"{machine['threads']} torch thread(s), optimizer {machine.get('optimizer', 'sgd')} "
        f"(`foreach=True`). Command: `python experiments/"
        f"{machine['command']}`, {machine['date_utc']}. Counts are exact (a TorchDispatchMode, "
        'backward and optimizer included); "ops" counts views too, which launch no kernel, '
        '"compute" leaves them out. "/ one" is the fused step\'s count over one model\'s '
        "(separate / K). `fused`: a stock optimizer over the stacked parameters (one learning "
        "rate); `fused_opt`: `fusion.optimizer`, each model its own (what a search runs); "
        "`fused_pml`: `fusion.per_model_loss`. Times are CPU wall-clock medians on a shared, "
        "loaded machine (load average per row), not GPU figures.",
        "",
        "| model | K | separate ops (compute) | fused ops (compute) | fused / one: ops, compute "
        "| fused_opt ops (compute) | fused_opt / one: ops, compute | fused_pml ops "
        "| CPU separate s | CPU fused s | CPU speed-up | load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['k']} | {r['separate_ops']} ({r['separate_compute_ops']}) | "
            f"{r['fused_ops']} ({r['fused_compute_ops']}) | "
            f"{ratio(r, 'fused')}, {ratio(r, 'fused', '_compute')} | "
            f"{r['fused_opt_ops']} ({r['fused_opt_compute_ops']}) | "
            f"{ratio(r, 'fused_opt')}, {ratio(r, 'fused_opt', '_compute')} | "
            f"{r['fused_pml_ops']} | {r['separate_s']:.4f} | {r['fused_s']:.4f} | "
            f"{r['speedup']:.2f}x | {r['loadavg_1min']:.1f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
