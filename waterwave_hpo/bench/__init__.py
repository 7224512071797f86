"""``waterwave-hpo bench``: one workload under every way of sharing a device, side by side.

``run_bench(BenchConfig(...))`` runs temporal sharing, Optuna ``n_jobs=K`` threads, K
processes, ``cudaMallocAsync`` with K streams (CUDA only) and the waterwave executor (``fifo``
and ``waterwave`` policies, and with HOME memory plans: ``waterwave-plans``) on a ResNet-style
CNN, a GPT-style language model and the demo's digits NAS, at a light and a high memory demand,
and writes ``results.csv``, ``results.json``, plots and a ``README.md``; ``compare_plans``
simulates co-hosting with and without memory plans (``plans.csv``). ``zoo_cases`` and
``check_case`` run fusion on timm and transformers models (the ``zoo`` extra), ``count_ops``
counts the ATen operations of a training step.

``run_search_bench(SearchConfig(...))`` (``waterwave-hpo bench --search``) measures time to a
good model instead of throughput: the demo's NAS + HPO search under each way of sharing the
device, several seeds each, and writes ``search.json``, ``search.png`` and a ``README.md``.
"""

from __future__ import annotations

from waterwave_hpo.bench._calibrate import fit_batches
from waterwave_hpo.bench._calibrate import profile_trial
from waterwave_hpo.bench._methods import Method
from waterwave_hpo.bench._methods import unavailable_reason
from waterwave_hpo.bench._opcount import OpCount
from waterwave_hpo.bench._opcount import OpCounter
from waterwave_hpo.bench._opcount import count_ops
from waterwave_hpo.bench._plans import PlanComparison
from waterwave_hpo.bench._plans import PlanSharing
from waterwave_hpo.bench._plans import compare_plans
from waterwave_hpo.bench._results import UNITS
from waterwave_hpo.bench._results import MethodResult
from waterwave_hpo.bench._results import results_table
from waterwave_hpo.bench._run import CPU_NOTICE
from waterwave_hpo.bench._run import BenchConfig
from waterwave_hpo.bench._run import BenchResult
from waterwave_hpo.bench._run import bench_file_names
from waterwave_hpo.bench._run import run_bench
from waterwave_hpo.bench._runners import Allocator
from waterwave_hpo.bench._runners import MethodRun
from waterwave_hpo.bench._runners import PoolNotInstalledError
from waterwave_hpo.bench._runners import run_method
from waterwave_hpo.bench._search_bench import SEARCH_FILES
from waterwave_hpo.bench._search_bench import SearchBenchResult
from waterwave_hpo.bench._search_bench import SearchConfig
from waterwave_hpo.bench._search_bench import run_search_bench
from waterwave_hpo.bench._search_budget import DeadlinePruner
from waterwave_hpo.bench._search_methods import SearchMethod
from waterwave_hpo.bench._search_results import SearchRun
from waterwave_hpo.bench._search_results import Target
from waterwave_hpo.bench._search_results import TrialOutcome
from waterwave_hpo.bench._search_results import time_to_target
from waterwave_hpo.bench._search_run import SearchSettings
from waterwave_hpo.bench._search_run import run_search
from waterwave_hpo.bench._train import TrialRecord
from waterwave_hpo.bench._workloads import BasicBlock
from waterwave_hpo.bench._workloads import Setting
from waterwave_hpo.bench._workloads import Workload
from waterwave_hpo.bench._workloads import WorkloadSpec
from waterwave_hpo.bench._workloads import build_resnet
from waterwave_hpo.bench._workloads import draw_params
from waterwave_hpo.bench._zoo import FAST_SAMPLE
from waterwave_hpo.bench._zoo import TIMM_SAMPLE
from waterwave_hpo.bench._zoo import TRANSFORMERS_SAMPLE
from waterwave_hpo.bench._zoo import ZooCase
from waterwave_hpo.bench._zoo import ZooOutcome
from waterwave_hpo.bench._zoo import ZooResult
from waterwave_hpo.bench._zoo import check_case
from waterwave_hpo.bench._zoo import import_timm
from waterwave_hpo.bench._zoo import zoo_case
from waterwave_hpo.bench._zoo import zoo_cases

__all__ = [
    "CPU_NOTICE",
    "FAST_SAMPLE",
    "SEARCH_FILES",
    "TIMM_SAMPLE",
    "TRANSFORMERS_SAMPLE",
    "UNITS",
    "Allocator",
    "BasicBlock",
    "BenchConfig",
    "BenchResult",
    "DeadlinePruner",
    "Method",
    "MethodResult",
    "MethodRun",
    "OpCount",
    "OpCounter",
    "PlanComparison",
    "PlanSharing",
    "PoolNotInstalledError",
    "SearchBenchResult",
    "SearchConfig",
    "SearchMethod",
    "SearchRun",
    "SearchSettings",
    "Setting",
    "Target",
    "TrialOutcome",
    "TrialRecord",
    "Workload",
    "WorkloadSpec",
    "ZooCase",
    "ZooOutcome",
    "ZooResult",
    "bench_file_names",
    "build_resnet",
    "check_case",
    "compare_plans",
    "count_ops",
    "draw_params",
    "fit_batches",
    "import_timm",
    "profile_trial",
    "results_table",
    "run_bench",
    "run_method",
    "run_search",
    "run_search_bench",
    "time_to_target",
    "unavailable_reason",
    "zoo_case",
    "zoo_cases",
]
