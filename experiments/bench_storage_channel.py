"""Per-trial cost of the hosts' storage channel: Ray relay against the old gRPC proxy.

One local Ray instance, one host-like actor, the driver's in-memory storage. The actor runs the
same trials through each channel in alternating rounds (one run, so both see the same load):

* ``grpc-proxy``: what ``RayExecutor`` used before the relay: Optuna's gRPC storage proxy
  (``GrpcStorageProxy`` client, Optuna's servicer on an insecure loopback port);
* ``ray-relay``: ``waterwave_hpo.cluster._storage``: ``RayStorageClient`` -> ``StorageRelay``
  actor -> ``StorageServer`` thread in the driver, with the one-study policy checked per call.

A trial is what a host does for a small objective: ask (TPE, default settings), three
``suggest_float``, ``steps`` reports each followed by ``should_prune``, one user attribute, tell.
Each round uses a fresh study, so both channels see studies of the same size. Figures are
wall-clock seconds on a shared CPU machine (load recorded); the ratio within one run is the
figure to read. Not a GPU number.

Usage::

    python experiments/bench_storage_channel.py [--trials 40] [--rounds 3] [--steps 5]
        [--out experiments/results/<date>-storage-channel]
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
import datetime
import json
import os
from pathlib import Path
import platform
import statistics
import time
from typing import Any

import optuna
import ray

from waterwave_hpo.cluster._storage import StorageServer


class TrialRunner:
    """The host side: runs trials against a storage it was given."""

    def run(self, storage: Any, study_name: str, n_trials: int, steps: int) -> float:
        """Seconds per trial, over ``n_trials`` trials."""
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        if hasattr(storage, "connect"):
            storage = storage.connect()
        study = optuna.load_study(study_name=study_name, storage=storage)
        start = time.perf_counter()
        for _ in range(n_trials):
            trial = study.ask()
            x = sum(trial.suggest_float(name, 0.0, 1.0) for name in ("a", "b", "c"))
            for step in range(steps):
                trial.report(x / (step + 1), step)
                trial.should_prune()
            trial.set_user_attr("host", "bench")
            study.tell(trial, x)
        return (time.perf_counter() - start) / n_trials


def _grpc_server(storage: optuna.storages.BaseStorage) -> tuple[Any, int]:
    """The pre-issue-18 server: Optuna's servicer on an insecure port (here loopback)."""
    import grpc
    from optuna.storages._grpc import servicer
    from optuna.storages._grpc.auto_generated import api_pb2_grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=16))
    api_pb2_grpc.add_StorageServiceServicer_to_server(  # type: ignore[no-untyped-call]
        servicer.OptunaStorageProxyService(storage), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    runner = ray.remote(TrialRunner).options(num_cpus=1).remote()
    storage = optuna.storages.InMemoryStorage()
    per_trial_s: dict[str, list[float]] = {"grpc-proxy": [], "ray-relay": []}
    loads = [os.getloadavg()]
    try:
        for round_index in range(args.rounds):
            for channel in per_trial_s:
                study = optuna.create_study(study_name=f"{channel}-{round_index}", storage=storage)
                if channel == "grpc-proxy":
                    from optuna.storages import GrpcStorageProxy

                    server, port = _grpc_server(storage)
                    client: Any = GrpcStorageProxy(host="127.0.0.1", port=port)
                    client.wait_server_ready(timeout=30)
                    try:
                        seconds = ray.get(
                            runner.run.remote(client, study.study_name, args.trials, args.steps)
                        )
                    finally:
                        server.stop(1.0).wait(2.0)
                else:
                    with StorageServer(study) as relay_server:
                        seconds = ray.get(
                            runner.run.remote(
                                relay_server.channel, study.study_name, args.trials, args.steps
                            )
                        )
                per_trial_s[channel].append(seconds)
                loads.append(os.getloadavg())
                print(f"round {round_index} {channel}: {seconds * 1e3:.1f} ms per trial")
    finally:
        ray.shutdown()
    medians = {name: statistics.median(values) for name, values in per_trial_s.items()}
    result = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs (shared)",
        "python": platform.python_version(),
        "optuna": optuna.__version__,
        "ray": ray.__version__,
        "command": "python experiments/bench_storage_channel.py "
        f"--trials {args.trials} --rounds {args.rounds} --steps {args.steps}",
        "trials_per_round": args.trials,
        "steps_per_trial": args.steps,
        "per_trial_s": per_trial_s,
        "median_per_trial_s": medians,
        "ratio_relay_over_grpc": medians["ray-relay"] / medians["grpc-proxy"],
        "loadavg_1_5_15": loads,
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
