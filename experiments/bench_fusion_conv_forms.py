"""Fused steps on the CPU with the convolution form chosen per layer: operations and speed.

For the four models of fusion_op_counts.py (digits MLP, small CNN, timm resnet18 at 32x32 batch
8, BERT 2x64) at K = 1, 4, 8 it counts the ATen operations of one training step (forward,
cross-entropy, backward, SGD ``foreach=True``; a TorchDispatchMode, views included) fused and
separate, twice: with every fused 2-d convolution grouped (``FusedConv.autotune = False``: what
CUDA runs, the choice being made on the CPU only) and with the form each layer's one-time timing
chose on this CPU (grouped or im2col + one ``bmm``). For resnet18 at ``--speed-ks`` it times, in
CPU seconds of this process (``time.process_time``: one torch thread, so time other processes
take on a loaded machine is not counted), interleaved, median of ``--reps``:

* ``one``: one model's step;
* ``separate``: K models' steps one after another (what K trials cost trained one at a time);
* ``fused_grouped`` and ``fused_tuned``: one fused step of the K models.

Run::

    python experiments/bench_fusion_conv_forms.py --reps 5

First, per convolution of resnet18 at the largest of ``--speed-ks`` (``--layers-only``: only
this), forward and backward in CPU seconds: K dense convolutions one after another, the
grouped form, the ``bmm`` form. Writes results.json to ``--out``
(default ``experiments/results/<date>-fusion-conv-forms/``).
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

from waterwave_hpo import fusion
from waterwave_hpo.bench import count_ops
from waterwave_hpo.fusion import _conv_forms

sys.path.insert(0, str(Path(__file__).parent))
import fusion_op_counts as workloads


def _fused_module(step: Callable[[], None]) -> fusion.FusedModule:
    """The fused module a step of ``workloads.steps`` closes over."""
    for cell in step.__closure__ or ():
        if isinstance(cell.cell_contents, fusion.FusedModule):
            return cell.cell_contents
    raise LookupError("no fused module in the step")


def _prepared(name: str, k: int, tune: bool) -> dict[str, Callable[[], None]]:
    work = workloads.steps(name, k)
    for module in _fused_module(work["fused"]).modules():
        if isinstance(module, fusion.FusedConv):
            module.autotune = tune
    for run in work.values():
        run()  # warm-up: optimizer state, and the convolution forms chosen (tune=True)
    return work


def _forms(step: Callable[[], None]) -> dict[str, list[str]]:
    fused = _fused_module(step)
    return {
        path: sorted(set(module.forms.values()))
        for path, module in fused.stacked.named_modules()
        if isinstance(module, fusion.FusedConv) and module.forms
    }


RESNET18_CONVS: tuple[tuple[str, int, int, int, int, int, int], ...] = (
    ("layer1 conv", 64, 64, 3, 1, 1, 8),
    ("layer2 conv", 128, 128, 3, 1, 1, 4),
    ("layer3 first conv", 128, 256, 3, 2, 1, 4),
    ("layer3 conv", 256, 256, 3, 1, 1, 2),
    ("layer4 first conv", 256, 512, 3, 2, 1, 2),
    ("layer4 conv", 512, 512, 3, 1, 1, 1),
    ("layer4 downsample", 256, 512, 1, 2, 0, 2),
)
"""resnet18's convolutions at 32x32: (name, C, O, kernel, stride, padding, input side)."""


def _median_seconds(step: Callable[[], None], reps: int) -> float:
    step()
    times = []
    for _ in range(reps):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return statistics.median(times)


def _layer_row(
    layer: tuple[str, int, int, int, int, int, int], k: int, reps: int, batch: int
) -> dict[str, Any]:
    name, c, o, size, stride, pad, side = layer
    x = torch.randn(batch, k * c, side, side, requires_grad=True)
    w = torch.randn(k, o, c, size, size, requires_grad=True)
    geometry = ((stride, stride), (pad, pad), (1, 1), 1)
    xs = [torch.randn(batch, c, side, side, requires_grad=True) for _ in range(k)]
    ws = [torch.randn(o, c, size, size, requires_grad=True) for _ in range(k)]

    def dense() -> None:
        for xi, wi in zip(xs, ws, strict=True):
            torch.nn.functional.conv2d(xi, wi, None, stride, pad).sum().backward()

    def form(f: Any) -> Callable[[], None]:
        return lambda: f(x, w, None, k, geometry).sum().backward()

    return {
        "layer": name,
        "k": k,
        "dense_s": _median_seconds(dense, reps),
        "grouped_s": _median_seconds(form(_conv_forms.grouped), reps),
        "bmm_s": _median_seconds(form(_conv_forms.batched_matmul), reps),
        "loadavg_1min": os.getloadavg()[0],
    }


def layer_times(k: int, reps: int, batch: int = 8) -> list[dict[str, Any]]:
    """Per resnet18 convolution: K dense ones, the grouped form, the bmm form (fwd + bwd)."""
    rows = []
    for layer in RESNET18_CONVS:
        row = _layer_row(layer, k, reps, batch)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ks", type=int, nargs="*", default=[1, 4, 8])
    parser.add_argument("--speed-ks", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--models", nargs="*", default=list(workloads.MODELS))
    parser.add_argument("--layers-only", action="store_true", help="only the per-layer table")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path("experiments/results") / f"{dt.date.today()}-fusion-conv-forms"
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    layers = layer_times(max(args.speed_ks), args.reps)
    counts: list[dict[str, Any]] = []
    for name in [] if args.layers_only else args.models:
        for k in args.ks:
            row: dict[str, Any] = {"model": name, "k": k}
            for tune in (False, True):
                work = _prepared(name, k, tune)
                fused = count_ops(work["fused"])
                tag = "tuned" if tune else "grouped"
                row[f"fused_{tag}_ops"] = fused.total
                row[f"fused_{tag}_compute_ops"] = fused.compute
                if not tune:
                    separate = count_ops(work["separate"])
                    row["one_model_ops"] = separate.total / k
                    row["one_model_compute_ops"] = separate.compute / k
                else:
                    row["forms"] = _forms(work["fused"])
            counts.append(row)
            print(json.dumps(row), flush=True)
    speed: list[dict[str, Any]] = []
    for k in [] if args.layers_only else args.speed_ks:
        grouped = _prepared("resnet18", k, False)
        tuned = _prepared("resnet18", k, True)
        single = _prepared("resnet18", 1, True)
        runs = {
            "one": single["separate"],
            "separate": grouped["separate"],
            "fused_grouped": grouped["fused"],
            "fused_tuned": tuned["fused"],
        }
        times: dict[str, list[float]] = {method: [] for method in runs}
        load = os.getloadavg()[0]
        for _ in range(args.reps):
            for method, run in runs.items():
                start = time.process_time()
                run()
                times[method].append(time.process_time() - start)
        medians = {method: statistics.median(ts) for method, ts in times.items()}
        speed_row = {
            "model": "resnet18",
            "k": k,
            **{f"{method}_s": value for method, value in medians.items()},
            "separate_over_fused_grouped": medians["separate"] / medians["fused_grouped"],
            "separate_over_fused_tuned": medians["separate"] / medians["fused_tuned"],
            "k_times_one_over_fused_tuned": k * medians["one"] / medians["fused_tuned"],
            "loadavg_1min_before": load,
            "loadavg_1min_after": os.getloadavg()[0],
        }
        speed.append(speed_row)
        print(json.dumps(speed_row), flush=True)
    machine = {
        "machine": f"{platform.machine()} VM, {os.cpu_count()} cores, CPU only",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": 1,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    result = {"machine": machine, "layers": layers, "op_counts": counts, "speed": speed}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out}/results.json")


if __name__ == "__main__":
    main()
