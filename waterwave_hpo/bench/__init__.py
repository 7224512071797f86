"""``waterwave-hpo bench``: one workload under every way of sharing a device, side by side.

``run_bench(BenchConfig(...))`` runs temporal sharing, Optuna ``n_jobs=K`` threads, K
processes, ``cudaMallocAsync`` with K streams (CUDA only) and the waterwave executor (``fifo``
and ``waterwave`` policies, and with HOME memory plans: ``waterwave-plans``) on a ResNet-style
CNN, a GPT-style language model and the demo's digits NAS, at a light and a high memory demand,
and writes ``results.csv``, ``results.json``, plots and a ``README.md``; ``compare_plans``
simulates co-hosting with and without memory plans (``plans.csv``).
"""

from __future__ import annotations

from waterwave_hpo.bench._calibrate import fit_batches
from waterwave_hpo.bench._calibrate import profile_trial
from waterwave_hpo.bench._methods import Method
from waterwave_hpo.bench._methods import unavailable_reason
from waterwave_hpo.bench._plans import PlanComparison
from waterwave_hpo.bench._plans import PlanSharing
from waterwave_hpo.bench._plans import compare_plans
from waterwave_hpo.bench._results import UNITS
from waterwave_hpo.bench._results import MethodResult
from waterwave_hpo.bench._results import results_table
from waterwave_hpo.bench._run import CPU_NOTICE
from waterwave_hpo.bench._run import BenchConfig
from waterwave_hpo.bench._run import BenchResult
from waterwave_hpo.bench._run import run_bench
from waterwave_hpo.bench._runners import Allocator
from waterwave_hpo.bench._runners import MethodRun
from waterwave_hpo.bench._runners import PoolNotInstalledError
from waterwave_hpo.bench._runners import run_method
from waterwave_hpo.bench._train import TrialRecord
from waterwave_hpo.bench._workloads import Setting
from waterwave_hpo.bench._workloads import Workload
from waterwave_hpo.bench._workloads import WorkloadSpec
from waterwave_hpo.bench._workloads import draw_params

__all__ = [
    "CPU_NOTICE",
    "UNITS",
    "Allocator",
    "BenchConfig",
    "BenchResult",
    "Method",
    "MethodResult",
    "MethodRun",
    "PlanComparison",
    "PlanSharing",
    "PoolNotInstalledError",
    "Setting",
    "TrialRecord",
    "Workload",
    "WorkloadSpec",
    "compare_plans",
    "draw_params",
    "fit_batches",
    "profile_trial",
    "results_table",
    "run_bench",
    "run_method",
    "unavailable_reason",
]
