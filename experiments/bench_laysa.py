"""LaySA against dense all-reduce, fp16 compression, PowerSGD and naive top-k.

Every method trains the same MLP on scikit-learn's digits for the same epochs, one after the
other inside the same spawned gloo group (so they share the machine's load), at 2 and 4
processes on the CPU::

    python experiments/bench_laysa.py --world-sizes 2 4 --epochs 12 --density 0.01

Per method it records, on every rank:

* bytes this rank hands to collectives per step (exact: ``nbytes`` of every tensor passed to
  ``all_reduce`` / ``all_gather_single``, counted by wrapping those functions), in a sparse
  step after warm-up; and the ring-algorithm wire bytes that implies (formula, said so);
* extra memory of the communication state at its peak (exact bytes of the hook's own buffers:
  LaySA's and naive top-k's ledgers; PowerSGD's error, P and Q tensors; fp16's half-precision
  copies of the buckets; dense: none);
* test accuracy after the epochs (rank 0; replicas are identical);
* mean step time as a ratio to dense, in this run. A CPU with gloo over loopback says little
  about a GPU interconnect: there computation is faster and the wire relatively slower.

Writes results.json, README.md and laysa.png to ``--out`` (default
``experiments/results/<date>-laysa-cpu/``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import datetime as dt
import itertools
import json
import os
from pathlib import Path
import platform
import socket
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from waterwave_hpo.distributed import Baseline
from waterwave_hpo.distributed import NaiveTopKState
from waterwave_hpo.distributed import attach_baseline
from waterwave_hpo.distributed import laysa

METHODS = ("dense", "fp16", "powersgd", "naive_topk", "laysa")
HIDDEN = (256, 256, 256)


class ByteCounter:
    """Wraps the collectives the hooks call and adds up the bytes this rank passes in."""

    def __init__(self) -> None:
        self.bytes = 0
        self.kinds: dict[str, int] = {}
        for name in ("all_reduce", "all_gather_single", "all_gather_into_tensor"):
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[0] if name == "all_reduce" else args[1]
            self.bytes += tensor.nbytes
            self.kinds[name] = self.kinds.get(name, 0) + tensor.nbytes
            return original(*args, **kwargs)

        return counted


def _data(rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )
    shard = slice(rank, None, world_size)
    return (
        torch.from_numpy(x_train[shard]),
        torch.from_numpy(y_train[shard]).long(),
        torch.from_numpy(x_test),
        torch.from_numpy(y_test).long(),
    )


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    sizes = (64, *HIDDEN, 10)
    layers: list[torch.nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _extra_bytes(method: str, state: Any, model: torch.nn.Module) -> int:
    if method == "dense":
        return 0
    if method == "fp16":  # an fp16 copy of every bucket, alive until its all-reduce ends
        return sum(p.numel() for p in model.parameters()) * 2
    if method == "powersgd":
        tensors = [
            *state.error_dict.values(),
            *state.p_memory_dict.values(),
            *state.q_memory_dict.values(),
        ]
        return int(sum(t.nbytes for t in tensors))
    return int(state.ledger.peak_bytes)


def _run_method(
    method: str, rank: int, world_size: int, args: argparse.Namespace, counter: ByteCounter
) -> dict[str, Any]:
    x_train, y_train, x_test, y_test = _data(rank, world_size)
    model = DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    state: Any = None
    if method == "laysa":
        state = laysa(
            model, density=args.density, optimizer=optimizer, warmup_steps=args.warmup_steps
        ).state
    else:
        state = attach_baseline(
            model, Baseline(method), density=args.density, warmup_steps=args.warmup_steps
        )
    generator = torch.Generator().manual_seed(1)
    step_times: list[float] = []
    step_bytes: list[int] = []
    steps_per_epoch = len(x_train) // args.batch_size  # equal on every rank (drop the tail)
    for _ in range(args.epochs):
        order = torch.randperm(len(x_train), generator=generator)
        for step in range(steps_per_epoch):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            before = counter.bytes
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
            step_times.append(time.perf_counter() - start)
            step_bytes.append(counter.bytes - before)
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    n_params = sum(p.numel() for p in model.parameters())
    steady = step_times[args.warmup_steps + 2 :]
    return {
        "method": method,
        "bytes_per_step": step_bytes[-1],
        "bytes_first_step": step_bytes[0],
        "extra_memory_bytes": _extra_bytes(method, state, model.module),
        "model_bytes": n_params * 4,
        "n_params": n_params,
        "accuracy": accuracy,
        "mean_step_s": float(np.mean(steady)),
        "median_step_s": float(np.median(steady)),
        "steps": len(step_times),
        "naive_residual_bytes": (
            sum(t.nbytes for t in state.residuals.values())
            if isinstance(state, NaiveTopKState)
            else None
        ),
    }


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    counter = ByteCounter()
    results = []
    try:
        for method in args.methods:
            dist.barrier()
            results.append(_run_method(method, rank, world_size, args, counter))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ring_wire_bytes(method: str, payload: int, world_size: int) -> float:
    """Bytes a rank sends on a ring: all-reduce 2(W-1)/W x payload, all-gather (W-1) x."""
    if method in ("naive_topk", "laysa"):
        return float((world_size - 1) * payload)
    return 2 * (world_size - 1) / world_size * payload


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    panels = [
        ("bytes_per_step", "bytes sent per step per rank (log)", True),
        (
            "extra_memory_bytes",
            "extra memory of comm state, bytes (log; dense: 0, drawn at 1)",
            True,
        ),
        ("accuracy", "test accuracy after the epochs", False),
        ("step_time_ratio", "step time / dense (same run, CPU)", False),
    ]
    width = 0.8 / len(sizes)
    for axis, (key, title, log) in zip(axes, panels, strict=True):
        for i, size in enumerate(sizes):
            values = [
                next(r[key] for r in rows if r["world_size"] == size and r["method"] == m)
                for m in METHODS
            ]
            plotted = [max(v, 1) if log else v for v in values]
            axis.bar(np.arange(len(METHODS)) + i * width, plotted, width, label=f"{size} processes")
        axis.set_xticks(
            np.arange(len(METHODS)) + width * (len(sizes) - 1) / 2, METHODS, rotation=30
        )
        axis.set_title(title, fontsize=9)
        if log:
            axis.set_yscale("log")
        if key == "accuracy":
            axis.set_ylim(0.8, 1.0)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()
    out = args.out or Path(__file__).parent / "results" / f"{today}-laysa-cpu"
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started = time.time()
    rows: list[dict[str, Any]] = []
    for world_size in args.world_sizes:
        result_file = out / f"_raw-{world_size}.json"
        mp.spawn(
            _worker,
            args=(world_size, _free_port(), args, str(result_file)),
            nprocs=world_size,
            join=True,
        )
        results = json.loads(result_file.read_text())
        result_file.unlink()
        dense = next(r for r in results if r["method"] == "dense")
        naive = next((r for r in results if r["method"] == "naive_topk"), None)
        for r in results:
            r["world_size"] = world_size
            r["ring_wire_bytes_per_step"] = _ring_wire_bytes(
                r["method"], r["bytes_per_step"], world_size
            )
            r["bytes_vs_dense"] = dense["bytes_per_step"] / max(r["bytes_per_step"], 1)
            r["step_time_ratio"] = r["mean_step_s"] / dense["mean_step_s"]
            r["accuracy_minus_dense_points"] = 100 * (r["accuracy"] - dense["accuracy"])
            r["extra_memory_vs_naive"] = (
                r["extra_memory_bytes"] / naive["extra_memory_bytes"] if naive else None
            )
            rows.append(r)
    meta = {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.machine(),
            "cpu_count": os.cpu_count(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
        },
        "command": "python " + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": f"MLP 64-{'-'.join(map(str, HIDDEN))}-10, SGD momentum 0.9",
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_s": time.time() - started,
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if set(args.methods) == set(METHODS):
        _plot(rows, out / "laysa.png")
    print(json.dumps(meta, indent=1))
    for r in rows:
        print(
            r["world_size"],
            r["method"],
            r["bytes_per_step"],
            r["extra_memory_bytes"],
            round(r["accuracy"], 4),
            round(r["step_time_ratio"], 2),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
