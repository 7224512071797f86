"""The issue-5 comparison: one workload under every way of sharing a device, side by side.

Same as ``waterwave-hpo bench`` (this script only forwards its arguments)::

    python experiments/bench_sharing.py --budget-s 600            # on a CUDA GPU: full matrix
    python experiments/bench_sharing.py --device cpu --k 4 --trials 8 --budget-s 300

Methods: temporal; Optuna ``n_jobs=K`` threads (stock allocator); K spawned processes (MPS if
running); ``backend:cudaMallocAsync`` with K streams (CUDA only; reported "not available on
this device" elsewhere); the waterwave executor with the ``fifo`` and ``waterwave`` policies.
Workloads: ResNet-style CNN (32x32), GPT-style LM, the demo's digits NAS, each at a light and
a high memory demand. Writes README.md, results.csv, results.json and PNG plots to ``--out``
(default ``experiments/results/<date>-<device>/``). See ``waterwave_hpo.bench``.
"""

from __future__ import annotations

import sys

from waterwave_hpo.cli._main import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
