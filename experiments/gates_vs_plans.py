"""NodeGroup gates or a HOME memory plan for a gated model: which wins, where.

A model wrapped by ``ww.pipeline`` and registered with ``ww.fit_trial_memory`` under
``WaterwaveExecutor(memory_plan="home")`` runs either under its gates (each NodeGroup's saved
bytes reserved as its forward starts and released as its backward ends; no step time lost) or
with a plan (keep/swap/recompute per unit, HOME, IEEE TC 2022: a smaller peak, a slower step,
its footprint reserved for the trial's life). The executor picks the gates when their claim at
the step's peak (parameters + gradients + every group's saved bytes) fits the memory the
neighbours leave, else a plan for that memory (when the claim fits the device and only the
neighbours leave too little, only a plan of at most ``GATED_PLAN_MAX_SLOWDOWN`` of the step
time). This script measures, for three models on the
CPU, with bytes only (no timings):

1. **Ledger** (the real executor, one trial, CPU): for budgets from 0.6x to 1.5x the gates'
   claim, the outcome and the scheduler ledger's peak under ``gates`` (memory_plan="off"),
   ``plan`` (the model without gates, memory_plan="home") and ``pick`` (gated,
   memory_plan="home": what the executor does now).
2. **Simulated device** (``waterwave_hpo.sim``, deterministic): 8 trials of 20 steps, 4 at a
   time, on capacities from 0.8x to 6x the claim, with the model's measured NodeGroup profile,
   its plain peak, its smallest plan and that plan's predicted slowdown (the cost model's):
   makespan in units of one solo trial, trials completed, failed, planned.

Run::

    python experiments/gates_vs_plans.py

Writes results.json and README.md to ``--out``
(default ``experiments/results/<date>-gates-vs-plans/``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import datetime as dt
import json
import logging
import os
from pathlib import Path
import platform
from typing import Any

import optuna
import torch
from torch import nn

import waterwave_hpo as ww
from waterwave_hpo.host._planning import GATED_PLAN_MAX_SLOWDOWN
from waterwave_hpo.nodegroup import trial_profile
from waterwave_hpo.planning import DEFAULT_BANDWIDTH_BYTES_PER_S
from waterwave_hpo.planning import PLANNERS
from waterwave_hpo.planning import remove_memory_plan
from waterwave_hpo.planning import step_profile_of
from waterwave_hpo.scheduler import TrialProfile
from waterwave_hpo.sim import Sharing
from waterwave_hpo.sim import SimDevice
from waterwave_hpo.sim import SimPlan
from waterwave_hpo.sim import SimTrial
from waterwave_hpo.sim import simulate


def _mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(256, 10))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 10),
    )


def _wide_mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 10))


WORKLOADS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "mlp 6x256, batch 512 (activations > weights)": (_mlp, lambda: torch.randn(512, 256)),
    "cnn 4 conv 32x32, batch 64 (activations >> weights)": (
        _cnn,
        lambda: torch.randn(64, 3, 32, 32),
    ),
    "mlp 3x1024, batch 32 (weights >> activations)": (_wide_mlp, lambda: torch.randn(32, 1024)),
}


def measure(build: Callable[[], nn.Module], batch: Callable[[], torch.Tensor]) -> dict[str, Any]:
    """The gates' claim and groups, the plain and the smallest planned peak, in bytes."""
    torch.manual_seed(0)
    gated = ww.pipeline(build(), example_input=batch())
    profile = trial_profile(gated)
    model = build()
    ww.fit_memory(model, 1 << 40, example_input=batch(), planner="none")
    steps = step_profile_of(model)
    remove_memory_plan(model)
    bw = DEFAULT_BANDWIDTH_BYTES_PER_S
    plain = PLANNERS["none"](steps, 0, bandwidth_bytes_per_s=bw, seed=0).prediction
    smallest = min(
        (
            PLANNERS[name](steps, 0, bandwidth_bytes_per_s=bw, seed=0).prediction
            for name in ("swap_all", "checkpoint_sqrt")
        ),
        key=lambda p: p.peak_bytes,
    )
    return {
        "gated_claim_bytes": profile.peak_bytes,
        "resident_bytes": profile.resident_bytes,
        "group_bytes": list(profile.group_bytes),
        "plain_peak_bytes": plain.peak_bytes,
        "smallest_plan_peak_bytes": smallest.peak_bytes,
        "smallest_plan_slowdown": round(max(1.0, smallest.step_s / max(plain.step_s, 1e-12)), 3),
    }


def ledger_run(
    build: Callable[[], nn.Module],
    batch: Callable[[], torch.Tensor],
    mode: str,
    budget: int,
) -> dict[str, Any]:
    """One trial under the executor on the CPU: its outcome and the ledger's peak bytes."""
    chosen: list[str] = []

    def objective(trial: optuna.trial.Trial) -> float:
        model = build()
        if mode in ("gates", "pick"):
            model = ww.pipeline(model)
        if mode in ("plan", "pick"):
            model = ww.fit_trial_memory(model, example_input=batch())
        plan = ww.current().planning
        if mode == "gates":
            chosen.append("gates")
        elif plan is not None and plan.plan is not None:
            chosen.append("plan")
        else:
            chosen.append("gates" if mode == "pick" else "plain")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x = batch()
        for _ in range(2):
            optimizer.zero_grad()
            model(x).float().sum().backward()
            optimizer.step()
        return 0.0

    executor = ww.WaterwaveExecutor(
        "cpu",
        trials_per_device=1,
        memory_budget_bytes=budget,
        memory_plan="off" if mode == "gates" else "home",
        record_trial_attrs=True,
    )
    study = optuna.create_study()
    executor.optimize(study, objective, n_trials=1, catch=(Exception,))
    stats = executor.schedulers["cpu"].stats()
    trial = study.trials[0]
    return {
        "state": trial.state.name,
        "ran_with": chosen[0] if chosen else None,
        "ledger_peak_bytes": stats.peak_bytes,
        "fail_reason": (trial.system_attrs.get("waterwave:fail_reason") or "")[:120] or None,
    }


def sim_run(
    m: dict[str, Any], mode: str, capacity: int, parallelism: float, slowdown: float
) -> dict[str, Any]:
    """8 trials of 20 steps, 4 at a time, on a simulated device of ``capacity`` bytes."""
    plan = SimPlan(m["smallest_plan_peak_bytes"], slowdown)
    gated = TrialProfile(m["resident_bytes"], tuple(m["group_bytes"]))
    if mode == "gates":
        trial, plans = SimTrial.uniform(gated, 1.0 / 20, 20), False
    elif mode == "plan":  # no gates: the registered model's footprint, held for its life
        footprint = TrialProfile(m["plain_peak_bytes"], (0,))
        trial, plans = SimTrial.uniform(footprint, 1.0 / 20, 20, plan=plan), True
    else:
        # pick, the executor's rule: the gates when their claim fits the room; else a plan for
        # the room, unless the claim fits the device and the plan is slower than
        # GATED_PLAN_MAX_SLOWDOWN (then the gates wait for the neighbours).
        waits = slowdown > GATED_PLAN_MAX_SLOWDOWN and m["gated_claim_bytes"] <= capacity
        trial = SimTrial.uniform(gated, 1.0 / 20, 20, plan=None if waits else plan)
        plans = not waits
    result = simulate(
        [trial] * 8,
        SimDevice(capacity, compute_parallelism=parallelism),
        Sharing(concurrency=4, memory_plans=plans, retry_on_oom=True),
    )
    return {
        "makespan_solo_trials": round(result.makespan_s, 3),
        "complete": result.n_complete,
        "failed": result.n_failed,
        "planned_attempts": result.n_planned,
        "evictions": result.evictions,
        "peak_bytes": result.peak_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    today = dt.date.today().isoformat()
    parser.add_argument("--out", default=f"experiments/results/{today}-gates-vs-plans")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    logging.getLogger("waterwave_hpo").setLevel(logging.ERROR)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
        "torch": torch.__version__,
        "loadavg_at_start": os.getloadavg(),
        "command": "python experiments/gates_vs_plans.py",
        "workloads": {},
    }
    for name, (build, batch) in WORKLOADS.items():
        m = measure(build, batch)
        claim = m["gated_claim_bytes"]
        ledger = {
            f"{f:.2f}x claim": {
                mode: ledger_run(build, batch, mode, int(f * claim))
                for mode in ("gates", "plan", "pick")
            }
            for f in (0.6, 0.8, 1.0, 1.5)
        }
        sim = {
            f"parallelism {p:g}, plan slowdown {sd:g}": {
                f"{f:.2f}x claim": {
                    mode: sim_run(m, mode, int(f * claim), p, sd)
                    for mode in ("gates", "plan", "pick")
                }
                for f in (0.8, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
            }
            for p in (1.0, 4.0)
            for sd in (m["smallest_plan_slowdown"], 1.5)
        }
        results["workloads"][name] = {"measured": m, "ledger": ledger, "sim": sim}
        print(name, json.dumps(m))
    results["loadavg_at_end"] = os.getloadavg()
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "README.md").write_text(_readme(results))
    print((out / "README.md").read_text())


def _readme(results: dict[str, Any]) -> str:
    lines = [
        "# Gates or plans for a gated model",
        "",
        f"`{results['command']}`; {results['machine']}, torch {results['torch']}; load "
        f"{results['loadavg_at_start'][0]:.2f} at start, {results['loadavg_at_end'][0]:.2f} at "
        "end. Bytes only (ledger and simulator), no timings: the load does not change them.",
        "",
    ]
    for name, w in results["workloads"].items():
        m = w["measured"]
        lines += [
            f"## {name}",
            "",
            f"gates' claim {m['gated_claim_bytes']} B (resident {m['resident_bytes']} B + "
            f"{len(m['group_bytes'])} groups), HOME plain peak {m['plain_peak_bytes']} B, "
            f"smallest plan {m['smallest_plan_peak_bytes']} B at "
            f"{m['smallest_plan_slowdown']}x the step time (cost model).",
            "",
            "Ledger, one trial on the CPU executor (state / ran with / ledger peak bytes):",
            "",
            "| budget | gates | plan | pick |",
            "| --- | --- | --- | --- |",
        ]
        for budget, runs in w["ledger"].items():
            cells = [
                f"{r['state']} / {r['ran_with']} / {r['ledger_peak_bytes']}"
                for r in (runs["gates"], runs["plan"], runs["pick"])
            ]
            lines.append(f"| {budget} | " + " | ".join(cells) + " |")
        for setting, table in w["sim"].items():
            lines += [
                "",
                f"Simulated device, {setting}: 8 trials x 20 steps, 4 at a time (makespan in "
                "solo trials / complete / planned attempts):",
                "",
                "| capacity | gates | plan | pick |",
                "| --- | --- | --- | --- |",
            ]
            for capacity, runs in table.items():
                cells = [
                    f"{r['makespan_solo_trials']} / {r['complete']} / {r['planned_attempts']}"
                    for r in (runs["gates"], runs["plan"], runs["pick"])
                ]
                lines.append(f"| {capacity} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
