"""Simulator studies (``waterwave_hpo.sim``): packing before launch, and beyond one device.

These are simulations, not measurements. Two tables:

1. ``trials_per_device="auto"`` as the simulator would choose it: the best K (shortest
   makespan with no failed trial) for trials of a given NodeGroup profile on one device, under
   the stock allocator (no ledger), ``fifo`` and ``waterwave``, for a few values of the
   device's compute parallelism (how many small trials' kernels overlap).
2. Beyond one box: D devices, each running its share of the trials (longest first, to the
   least loaded device) at the K chosen in table 1; makespan and speed-up over one device.

The profiles default to a ResNet-like trial whose solo peak is 45% of an 80 GiB device (high
memory demand at K >= 3). Usage::

    python experiments/bench_sim.py [--capacity-gib 80] [--trials 32] [--out DIR]

Writes ``README.md`` and ``results.json`` to ``--out`` (default
``experiments/results/<date>-sim/``) and prints the tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
import random

from waterwave_hpo.scheduler import TrialProfile
from waterwave_hpo.sim import Sharing
from waterwave_hpo.sim import SimDevice
from waterwave_hpo.sim import SimTrial
from waterwave_hpo.sim import predict_packing
from waterwave_hpo.sim import simulate

GiB = 1 << 30


def trials(n: int, capacity: int, seed: int) -> list[SimTrial]:
    """``n`` ResNet-like trials: resident 2-6% of capacity, 8 groups summing to 25-40%, 10-30 s
    of work in 20 steps; seeded."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        resident = int(capacity * rng.uniform(0.02, 0.06))
        activation = capacity * rng.uniform(0.25, 0.40)
        groups = [int(activation * w) for w in _weights(rng, 8)]
        out.append(
            SimTrial.uniform(
                TrialProfile.of(resident, groups), rng.uniform(0.5, 1.5), 20, name=str(i)
            )
        )
    return out


def _weights(rng: random.Random, n: int) -> list[float]:
    w = [rng.uniform(0.5, 1.5) for _ in range(n)]
    return [x / sum(w) for x in w]


def spread(ts: list[SimTrial], d: int) -> list[list[SimTrial]]:
    """Longest trial first, to the least loaded of ``d`` devices."""
    loads = [0.0] * d
    shares: list[list[SimTrial]] = [[] for _ in range(d)]
    for t in sorted(ts, key=lambda t: -t.solo_s):
        i = loads.index(min(loads))
        shares[i].append(t)
        loads[i] += t.solo_s
    return shares


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity-gib", type=float, default=80.0)
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    capacity = int(args.capacity_gib * GiB)
    ts = trials(args.trials, capacity, args.seed)
    rows = []
    print("1. best K per policy (simulated), makespan in s, speed-up over K=1")
    for parallelism in (1.0, 2.0, 4.0):
        for policy in (None, "fifo", "waterwave"):
            p = predict_packing(
                ts, capacity, policy, max_k=args.max_k, compute_parallelism=parallelism
            )
            name = policy or "stock allocator"
            best = p.option(p.best_k)
            rows.append(
                {
                    "compute_parallelism": parallelism,
                    "policy": name,
                    "best_k": p.best_k,
                    "makespan_s": best.makespan_s,
                    "speedup_over_k1": p.speedup,
                    "options": [o.__dict__ for o in p.options],
                }
            )
            print(
                f"   parallelism {parallelism:3.1f}  {name:<16} best K={p.best_k}  "
                f"{best.makespan_s:8.1f} s  {p.speedup:4.2f}x   "
                + " ".join(
                    f"K{o.k}:{o.makespan_s:.0f}{'*' if o.n_failed else ''}" for o in p.options
                )
            )
    print("   (* = some trial failed at that K: never chosen)")
    scale = []
    print("2. D devices, waterwave policy, parallelism 2, K from table 1 per device")
    single = None
    for d in (1, 2, 4, 8):
        makespans = []
        for share in spread(ts, d):
            if not share:
                continue
            k = predict_packing(
                share, capacity, "waterwave", max_k=args.max_k, compute_parallelism=2.0
            ).best_k
            r = simulate(share, SimDevice(capacity, compute_parallelism=2.0), Sharing(k))
            makespans.append(r.makespan_s)
        m = max(makespans)
        single = single or m
        scale.append({"devices": d, "makespan_s": m, "speedup": single / m})
        print(f"   D={d}: {m:8.1f} s  {single / m:4.2f}x")
    out = args.out or Path("experiments/results") / (
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}-sim"
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps(
            {"simulated": True, "capacity_bytes": capacity, "packing": rows, "scale": scale},
            indent=1,
        )
        + "\n"
    )
    lines = [
        "# Simulator studies (simulated, not measured)",
        "",
        f"`python experiments/bench_sim.py --capacity-gib {args.capacity_gib} --trials "
        f"{args.trials}`: {args.trials} ResNet-like trials on a {args.capacity_gib:g} GiB device.",
        "",
        "| parallelism | policy | best K | makespan s | x over K=1 |",
        "|---|---|---|---|---|",
        *[
            f"| {r['compute_parallelism']} | {r['policy']} | {r['best_k']} | "
            f"{r['makespan_s']:.1f} | {r['speedup_over_k1']:.2f} |"
            for r in rows
        ],
        "",
        "| devices | makespan s | speed-up |",
        "|---|---|---|",
        *[f"| {s['devices']} | {s['makespan_s']:.1f} | {s['speedup']:.2f} |" for s in scale],
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))
    print(f"wrote {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
