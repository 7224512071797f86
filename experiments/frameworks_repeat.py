"""Repeat a framework example's K=4 search and count trial states.

Runs ``experiments/<example>.py --trials 8 --k 4`` ``runs`` times in one process and prints, per
run, the trials' states, whether any two trials' [start, complete] intervals overlapped, and the
seconds taken, with the load average before and after (JSON)::

    python experiments/frameworks_repeat.py frameworks_transformers 6
    python experiments/frameworks_repeat.py frameworks_lightning 4
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
from pathlib import Path
import sys
import time
from types import ModuleType
import warnings


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _loadavg() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def main(argv: list[str]) -> dict[str, object]:
    import optuna

    warnings.filterwarnings("ignore")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.disable(logging.WARNING)
    which, runs = argv[0], int(argv[1])
    example = _load(which)
    extra = ["--epochs", "2"] if "lightning" in which else []
    result: dict[str, object] = {"example": which, "loadavg_start": _loadavg()}
    rows = []
    for _ in range(runs):
        start = time.time()
        study = example.main(["--trials", "8", "--k", "4", *extra])
        states = [t.state.name for t in study.trials]
        spans = sorted((t.datetime_start, t.datetime_complete) for t in study.trials)
        overlap = any(b[0] < a[1] for a, b in itertools.pairwise(spans))
        rows.append(
            {
                "states": {s: states.count(s) for s in sorted(set(states))},
                "overlap": overlap,
                "seconds": round(time.time() - start, 1),
            }
        )
    result["runs"] = rows
    result["loadavg_end"] = _loadavg()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
