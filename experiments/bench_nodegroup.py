"""NodeGroup pipeline: co-hosted max batch as a fraction of solo, and gate overhead per step.

The paper's metric (Waterwave, IEEE TC 2023, Sec. 6: up to 96.8% of the solo maximum batch
size per co-hosted job), side by side for two co-hosted copies of a model:

* ``solo``: the largest batch one trial trains at alone under the budget;
* ``fifo`` / ``waterwave``: the largest batch at which *both* co-hosted copies train (no
  eviction), with NodeGroup gates and that scheduler policy;
* ``no gates``: the largest batch at which both copies' whole peaks fit at once (what two
  unscheduled trials need when their peaks coincide; computed from the profile, not run).

On the CPU (the only mode of this script) the budget is enforced by the scheduler's ledger:
every number is in *accounted* bytes (saved-for-backward activations + parameters +
gradients, as profiled), not measured device memory; the first (profiling) step of each
model is ungated. Batch sizes are found by bisection on real training runs (threads, one per
trial). Gate overhead: median step time with gates (inside a trial, uncontended scheduler)
minus without, in microseconds and % of the bare step.

Run (about a minute on 2 CPU cores)::

    python experiments/bench_nodegroup.py            # prints a table
    python experiments/bench_nodegroup.py --write    # also writes experiments/results/
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import contextlib
import copy
from dataclasses import asdict
from dataclasses import dataclass
import datetime
import json
import os
from pathlib import Path
import platform
import statistics
import subprocess
import sys
import threading
import time

import torch
from torch import nn

from waterwave_hpo.bench import BasicBlock
from waterwave_hpo.executor import TrialContext
from waterwave_hpo.executor import trial_scope
from waterwave_hpo.nodegroup import node_groups
from waterwave_hpo.nodegroup import pipeline
from waterwave_hpo.nodegroup import trial_profile
from waterwave_hpo.scheduler import BudgetExceededError
from waterwave_hpo.scheduler import PipelineScheduler


# ----------------------------------------------------------------------------- models
class ResNetish(nn.Module):
    """ResNet-style CNN. Input [B, 3, 16, 16] -> logits [B, 10]."""

    def __init__(self, c: int = 16, blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))
        self.blocks = nn.Sequential(*(BasicBlock(c) for _ in range(blocks)))
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.stem(x))).mean(dim=(2, 3)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPTish(nn.Module):
    """GPT-style transformer. Input token ids [B, T=32] -> logits [B, T, vocab=128]."""

    def __init__(
        self, vocab: int = 128, d: int = 64, heads: int = 4, layers: int = 3, ctx: int = 32
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln_f(self.blocks(x)))


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _image_batch(b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 3, 16, 16, generator=g), torch.randint(0, 10, (b,), generator=g)


def _token_batch(b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (b, 32), generator=g), torch.randint(0, 128, (b, 32), generator=g)


WORKLOADS = {
    "resnet": Workload("resnet", ResNetish, _image_batch, nn.functional.cross_entropy),
    "gpt": Workload(
        "gpt",
        GPTish,
        _token_batch,
        lambda out, y: nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)),
    ),
}


# ----------------------------------------------------------------------------- runs
def in_trial(
    scheduler: PipelineScheduler, n: int
) -> contextlib.AbstractContextManager[TrialContext]:
    """Run the body as trial ``n`` of ``scheduler``, as the executor does."""
    return trial_scope(scheduler, n)


def gated_model(w: Workload, batch: int, groups: int | str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return pipeline(w.build(), groups=groups, example_input=w.batch(batch, 99)[0])


def train(w: Workload, model: nn.Module, batch: int, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x, y = w.batch(batch, step)
        opt.zero_grad(set_to_none=False)
        w.loss(model(x), y).backward()
        opt.step()


def co_hosted_ok(
    w: Workload, batch: int, budget: int, policy: str, copies: int, steps: int, groups: int | str
) -> bool:
    """Whether ``copies`` co-hosted trials all finish ``steps`` steps at ``batch``, no trial
    evicted, *and* concurrently: every trial finished a forward pass before any trial ended
    (a policy that serializes whole trials is temporal sharing, not co-hosting)."""
    models = [gated_model(w, batch, groups, seed=i) for i in range(copies)]
    scheduler = PipelineScheduler(budget, policy)
    start = threading.Barrier(copies, timeout=60)
    failed: list[BaseException] = []
    first_forward_done: list[float] = []
    ended: list[float] = []

    def run(i: int) -> None:
        try:
            with in_trial(scheduler, i):
                start.wait()
                x, y = w.batch(batch, 0)
                loss = w.loss(models[i](x), y)
                first_forward_done.append(time.perf_counter())
                loss.backward()
                train(w, models[i], batch, steps - 1)
        except BudgetExceededError as e:
            failed.append(e)
        finally:
            ended.append(time.perf_counter())

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(copies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"{w.name} batch {batch} {policy}: a trial hung")
    assert scheduler.stats().peak_bytes <= budget
    concurrent = len(first_forward_done) == copies and max(first_forward_done) < min(ended)
    return not failed and concurrent


def largest_batch(ok: Callable[[int], bool], hi: int) -> int:
    """Largest b in [0, hi] with ok(b), assuming ok is monotone (bisection)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def per_sample_and_resident(w: Workload, groups: int | str) -> tuple[float, int]:
    """Accounted activation bytes per sample and resident bytes, from two profiles."""
    p8 = trial_profile(gated_model(w, 8, groups))
    p16 = trial_profile(gated_model(w, 16, groups))
    return (p16.activation_bytes - p8.activation_bytes) / 8, p8.resident_bytes


def paired_step_times(
    w: Workload, bare: nn.Module, gated: nn.Module, batch: int, steps: int
) -> tuple[list[float], list[float]]:
    """Alternate one bare and one gated training step, ``steps`` times each, inside one trial
    of an uncontended scheduler (the gates run, never wait). Returns seconds per step."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (bare, gated)]
    x, y = w.batch(batch, 0)
    out: tuple[list[float], list[float]] = ([], [])
    with in_trial(PipelineScheduler(2**40), 0):
        for _ in range(steps):
            for i, (m, opt) in enumerate(zip((bare, gated), opts, strict=True)):
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=False)
                w.loss(m(x), y).backward()
                opt.step()
                out[i].append(time.perf_counter() - t0)
    return out


def gate_path_us(n_gates: int, repeats: int = 20000) -> float:
    """Microseconds of the scheduler's acquire + release, uncontended, times ``n_gates``."""
    s = PipelineScheduler(2**40)
    s.trial_started(0)
    t0 = time.perf_counter()
    for _ in range(repeats):
        s.release(s.acquire(0, 1, 100))
    return (time.perf_counter() - t0) / repeats * 1e6 * n_gates


@dataclass
class Row:
    model: str
    budget_bytes: int
    resident_bytes: int
    activation_bytes_per_sample: float
    groups: int
    solo_batch: int
    no_gates_batch: int
    fifo_batch: int
    waterwave_batch: int
    no_gates_fraction: float
    fifo_fraction: float
    waterwave_fraction: float
    step_bare_us: float
    gate_overhead_us: float
    gate_overhead_pct: float
    scheduler_path_us: float
    timing_noise_us: float
    gates_per_step: int


def measure(w: Workload, solo_target: int, groups: int | str, steps: int, timing_steps: int) -> Row:
    per_sample, resident = per_sample_and_resident(w, groups)
    budget = int(resident + solo_target * per_sample)
    hi = solo_target * 2
    solo = largest_batch(lambda b: co_hosted_ok(w, b, budget, "waterwave", 1, steps, groups), hi)
    if solo == 0:
        raise RuntimeError(f"{w.name}: not even batch 1 fits the budget of {budget} bytes")
    fifo = largest_batch(lambda b: co_hosted_ok(w, b, budget, "fifo", 2, steps, groups), solo)
    ww = largest_batch(lambda b: co_hosted_ok(w, b, budget, "waterwave", 2, steps, groups), solo)

    def no_gates_fits(b: int) -> bool:
        return 2 * trial_profile(gated_model(w, b, groups)).peak_bytes <= budget

    no_gates = largest_batch(no_gates_fits, solo)

    batch = max(1, solo // 2)
    torch.manual_seed(0)
    bare = w.build()
    gated = pipeline(copy.deepcopy(bare), groups=groups, example_input=w.batch(batch, 99)[0])
    n_groups = len(node_groups(gated))
    paired_step_times(w, bare, gated, batch, 3)  # warm-up
    bare_s, gated_s = paired_step_times(w, bare, gated, batch, timing_steps)
    t_bare = statistics.median(bare_s)
    overhead = statistics.median(g - b for g, b in zip(gated_s, bare_s, strict=True))
    # the same measurement between two bare copies: what this machine cannot resolve
    a_s, b_s = paired_step_times(w, bare, copy.deepcopy(bare), batch, timing_steps)
    noise = statistics.median(abs(a - b) for a, b in zip(a_s, b_s, strict=True))
    return Row(
        model=w.name,
        budget_bytes=budget,
        resident_bytes=resident,
        activation_bytes_per_sample=per_sample,
        groups=n_groups,
        solo_batch=solo,
        no_gates_batch=no_gates,
        fifo_batch=fifo,
        waterwave_batch=ww,
        no_gates_fraction=no_gates / solo,
        fifo_fraction=fifo / solo,
        waterwave_fraction=ww / solo,
        step_bare_us=t_bare * 1e6,
        gate_overhead_us=overhead * 1e6,
        gate_overhead_pct=100 * overhead / t_bare,
        scheduler_path_us=gate_path_us(n_groups),
        timing_noise_us=noise * 1e6,
        gates_per_step=n_groups,
    )


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=sorted(WORKLOADS), choices=sorted(WORKLOADS))
    parser.add_argument(
        "--solo-batch",
        type=int,
        default=64,
        help="the budget is set so one trial's accounted peak fits about this batch",
    )
    parser.add_argument("--groups", default="8", help="NodeGroups per model, or 'auto'")
    parser.add_argument("--steps", type=int, default=6, help="training steps per feasibility run")
    parser.add_argument("--timing-steps", type=int, default=60)
    parser.add_argument("--write", action="store_true", help="write experiments/results/")
    args = parser.parse_args()
    groups: int | str = args.groups if args.groups == "auto" else int(args.groups)
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = [
        measure(WORKLOADS[m], args.solo_batch, groups, args.steps, args.timing_steps)
        for m in args.models
    ]
    wall_s = time.perf_counter() - started
    header = (
        "CPU, ledger-accounted bytes (activations saved for backward + params + grads; "
        "not measured device memory). Largest batch each of 2 co-hosted copies trains at, "
        "as a fraction of solo:"
    )
    lines = [header]
    lines.append(
        f"{'model':8} {'groups':>6} {'resident B':>10} {'act B/sample':>12} {'solo':>5} "
        f"{'no gates':>14} {'fifo':>14} {'waterwave':>14} {'gate overhead/step':>22} "
        f"{'sched. path':>11} {'noise':>9}"
    )
    for r in rows:
        lines.append(
            f"{r.model:8} {r.groups:>6} {r.resident_bytes:>10} "
            f"{r.activation_bytes_per_sample:>12.0f} {r.solo_batch:>5} "
            f"{r.no_gates_batch:>5} ({r.no_gates_fraction:6.1%}) "
            f"{r.fifo_batch:>5} ({r.fifo_fraction:6.1%}) "
            f"{r.waterwave_batch:>5} ({r.waterwave_fraction:6.1%}) "
            f"{r.gate_overhead_us:>8.1f} us ({r.gate_overhead_pct:5.1f}%) "
            f"{r.scheduler_path_us:>8.1f} us {r.timing_noise_us:>6.0f} us"
        )
    lines.append(
        "gate overhead/step: median over paired steps of (gated - bare); noise: median "
        "|difference| between two bare copies measured the same way (overheads below it are "
        "not resolved); sched. path: the scheduler's acquire+release alone, times the gates "
        "per step."
    )
    lines.append(f"wall time {wall_s:.1f} s")
    print("\n".join(lines))
    if args.write:
        meta = {
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {platform.processor()}".strip(),
            "cpu_cores": os.cpu_count(),
            "cpu_threads_used": 1,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "mode": "cpu-ledger (accounted bytes, not measured device memory)",
            "pythonpath": os.environ.get("PYTHONPATH", ""),
            "waterwave_hpo_from": str(Path(pipeline.__code__.co_filename).parents[2]),
            "git_commit": _git_commit(),
            "wall_s": round(wall_s, 1),
        }
        out = Path(__file__).parent / "results" / "bench_nodegroup_cpu.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
        md = out.with_suffix(".md")
        md.write_text(
            "# NodeGroup pipeline, CPU ledger\n\n"
            + "".join(f"- {k}: {v}\n" for k, v in meta.items())
            + "\n```\n"
            + "\n".join(lines)
            + "\n```\n"
        )
        print(f"wrote {out} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
