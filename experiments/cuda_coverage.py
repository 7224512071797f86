"""How much of the CUDA-only code the CPU suite runs under the fakes.

A line is *CUDA-only* when it can run only with a CUDA device. Found by reading the source (AST),
two rules:

1. **Guarded branches.** The body of an ``if`` whose test is a CUDA predicate (``x.is_cuda``,
   ``x == "cuda"``, ``x.startswith("cuda")``, ``torch.cuda.is_available()``, or an ``and`` with
   one of them); for a negated predicate (``not ...``, ``x != "cuda"``, and in the executor,
   cluster and planning packages ``stream is None``: a trial's stream exists only on CUDA; the
   pool's ``stream`` arguments are any integer on the simulated device) the ``else`` branch,
   and, when the ``if`` body ends in ``return``/``raise``/``continue``, the statements after it
   in the same block.
2. **CUDA-only functions** listed in :data:`CUDA_ONLY` (the CUDA driver's streams, CuPy, the
   allocator swap, the pool's guards inside PyTorch, the doctor's and the bench's GPU checks,
   the swap path's stream-ordered frees, the trial's backward threading), each named with why.

Coverage is coverage.py's statement coverage of those lines, from running ``--tests`` (the
tests that use ``tests/fakes/`` and those of the CUDA-facing modules; ``gpu``-marked tests skip
here): a lower bound of what the whole CPU suite runs (not run whole here: 2 shared cores).
Writes ``cuda_coverage.json`` and ``cuda_coverage.md`` to ``--out``.

    python experiments/cuda_coverage.py --out experiments/results/<date>-cuda-coverage
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterator
import datetime
import json
import os
from pathlib import Path
import platform
import subprocess
import sys

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "waterwave_hpo"

#: module (relative to waterwave_hpo/) -> functions/classes that run only with CUDA, and why.
CUDA_ONLY: dict[str, dict[str, str]] = {
    "host/_streams.py": {
        name: "per-slot streams from the CUDA driver"
        for name in (
            "_load_driver",
            "_check",
            "_driver_stream",
            "_pooled_stream",
            "acquire_stream",
            "release_stream",
        )
    },
    "host/_backward.py": {"backward_in_this_thread": "entered only on a trial's CUDA stream"},
    "memory/_cupy.py": {
        name: "CuPy runs only on CUDA"
        for name in ("CupySegmentSource", "_PoolBlock", "make_cupy_allocator", "cupy_on_stream")
    },
    "memory/_torch.py": {"_swap_allocator_locked": "PyTorch's CUDA allocator swap"},
    "memory/_torch_api.py": {"install_guards": "guards on torch.cuda while the pool serves it"},
    "planning/_apply.py": {
        "_free_after": "stream-ordered release of device memory",
        "_side_stream": "the swap copies' CUDA side stream",
    },
    "bench/_runners.py": {
        "_DevicePeak": "polls the device's memory",
        "_install_pool": "the pool as PyTorch's CUDA allocator",
    },
    "doctor/_checks.py": {
        name: "the doctor's GPU checks"
        for name in (
            "check_install_order_cuda",
            "torch_alloc_free_us",
            "check_alloc_latency_cuda",
            "check_canary_cuda",
            "check_oom_cuda",
            "_conv_step",
            "check_cudnn",
            "check_cohosted",
        )
    },
}

DEFAULT_TESTS = (
    "tests/executor/test_cuda_topology.py",
    "tests/executor/test_trial_stream.py",
    "tests/executor/test_install_order.py",
    "tests/executor/test_oom.py",
    "tests/executor/test_streams.py",
    "tests/memory/test_cupy_bridge.py",
    "tests/memory/test_use_pool_swap.py",
    "tests/planning/test_apply.py",
    "tests/memory/test_cuda_fake.py",
    "tests/memory/test_torch_api.py",
    "tests/memory/test_torch.py",
    "tests/bench/test_cuda_paths.py",
    "tests/bench/test_cuda_devices.py",
    "tests/nodegroup/test_autograd_thread.py",
    "tests/test_experimental.py",
    "tests/doctor/test_doctor.py",
)


def _is_cuda_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == "cuda"


def _polarity(test: ast.expr, trial_streams: bool) -> int:
    """+1: the test holds only with CUDA; -1: it holds only without; 0: neither."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return -_polarity(test.operand, trial_streams)
    if isinstance(test, ast.Attribute) and test.attr == "is_cuda":
        return 1
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, right = test.ops[0], test.comparators[0]
        if _is_cuda_str(right) or _is_cuda_str(test.left):
            return 1 if isinstance(op, (ast.Eq, ast.In)) else -1 if isinstance(op, ast.NotEq) else 0
        if isinstance(op, ast.Is) and isinstance(right, ast.Constant) and right.value is None:
            name = ast.unparse(test.left)
            return -1 if trial_streams and name.split(".")[-1] == "stream" else 0
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute):
        dotted = ast.unparse(test.func)
        if dotted == "torch.cuda.is_available":
            return 1
        if test.func.attr == "startswith" and test.args and _is_cuda_str(test.args[0]):
            return 1
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return 1 if any(_polarity(v, trial_streams) == 1 for v in test.values) else 0
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        return -1 if any(_polarity(v, trial_streams) == -1 for v in test.values) else 0
    return 0


def _span(nodes: list[ast.stmt]) -> Iterator[int]:
    for node in nodes:
        yield from range(node.lineno, (node.end_lineno or node.lineno) + 1)


def _blocks(node: ast.AST) -> Iterator[list[ast.stmt]]:
    for name in ("body", "orelse", "finalbody"):
        block = getattr(node, name, None)
        if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
            yield block
    for handler in getattr(node, "handlers", []):
        yield handler.body


def cuda_only_lines(path: Path, listed: dict[str, str]) -> set[int]:
    """The CUDA-only lines of one module, by the two rules of the module docstring."""
    trial_streams = path.relative_to(PACKAGE).parts[0] in ("executor", "cluster", "planning")
    tree = ast.parse(path.read_text(), filename=str(path))
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in listed:
                lines.update(_span(node.body))
        for block in _blocks(node):
            for i, stmt in enumerate(block):
                if not isinstance(stmt, ast.If):
                    continue
                polarity = _polarity(stmt.test, trial_streams)
                if polarity == 1:
                    lines.update(_span(stmt.body))
                elif polarity == -1:
                    lines.update(_span(stmt.orelse))
                    if isinstance(stmt.body[-1], (ast.Return, ast.Raise, ast.Continue)):
                        lines.update(_span(block[i + 1 :]))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tests", nargs="*", default=list(DEFAULT_TESTS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data_file = args.out / ".coverage"
    env = dict(os.environ, COVERAGE_FILE=str(data_file))
    cmd = [sys.executable, "-m", "coverage", "run", "--source", str(PACKAGE), "-m", "pytest"]
    cmd += [*args.tests, "-q", "-p", "no:cacheprovider"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-500:]

    import coverage

    cov = coverage.Coverage(data_file=str(data_file))
    cov.load()
    files = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        cuda = cuda_only_lines(path, CUDA_ONLY.get(rel, {}))
        if not cuda:
            continue
        _, statements, _, missing, _ = cov.analysis2(str(path))
        total = sorted(set(statements) & cuda)
        uncovered = sorted(set(missing) & cuda)
        if total:
            files.append(
                {
                    "file": rel,
                    "lines": len(total),
                    "run": len(total) - len(uncovered),
                    "not_run": uncovered,
                }
            )
    total = sum(f["lines"] for f in files)
    ran = sum(f["run"] for f in files)
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} VM, {os.cpu_count()} cores, CPU only (no GPU)",
        "python": platform.python_version(),
        "torch": __import__("torch").__version__,
        "loadavg": load,
        "tests": list(args.tests),
        "pytest": summary,
        "cuda_only_statements": total,
        "run_under_fakes": ran,
        "percent": round(100.0 * ran / total, 1) if total else None,
        "files": files,
    }
    (args.out / "cuda_coverage.json").write_text(json.dumps(result, indent=1) + "\n")
    rows = [
        f"| `{f['file']}` | {f['lines']} | {f['run']} | {100.0 * f['run'] / f['lines']:.0f}% |"
        for f in files
    ]
    md = [
        "# CUDA-only coverage under the fakes",
        "",
        f"{result['date']}, {result['machine']}, Python {result['python']}, "
        f"torch {result['torch']}, load average {' '.join(load)}.",
        f"Command: `python experiments/cuda_coverage.py --out {args.out}`; pytest: {summary}.",
        "",
        f"**{ran} of {total} CUDA-only statements run in CI under the fakes "
        f"({result['percent']}%).** Method: `experiments/cuda_coverage.py`'s docstring.",
        "",
        "| module | CUDA-only statements | run | % |",
        "|---|---|---|---|",
        *rows,
        "",
    ]
    (args.out / "cuda_coverage.md").write_text("\n".join(md))
    data_file.unlink(missing_ok=True)
    print("\n".join(md))


if __name__ == "__main__":
    main()
