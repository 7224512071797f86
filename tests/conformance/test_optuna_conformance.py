"""Optuna's own tests of ``Study.optimize`` pass with ``optimize`` routed through the executor.

The executor promises that its ``optimize`` means what ``optuna.Study.optimize`` means. This runs
Optuna's own test files (from the sdist of the installed Optuna version, fetched from the package
index with pip into a cache directory, the way a user gets them) in a separate pytest process with
``_optuna_plugin`` loaded, which routes every ``Study.optimize`` through
``WaterwaveExecutor(devices="cpu", trials_per_device=K)`` with ``isolation="threads"`` (every
file; an executor per call) and ``isolation="process"`` (``PROCESS_TEST_FILES``; one executor
for the whole run, its warm workers reused by every test), at K=1 and 4. Tests listed in
``_expected_different.py`` assert Optuna's internals and may fail; every other test must pass.

The sdist is cached in ``$WATERWAVE_CONFORMANCE_CACHE`` (default
``~/.cache/waterwave-hpo/conformance``). Without network access to the package index the test
skips, saying so, except where ``CI`` is set: there it fails.

Run only this suite: ``pytest -m conformance``; the full file list is ``OPTUNA_TEST_FILES``. By
default Optuna's storage-parametrized tests run on the in-memory storage only (CI's time budget);
``WATERWAVE_CONFORMANCE_STORAGES=all`` runs them on all of Optuna's ``STORAGE_MODES``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import shutil
import subprocess
import sys
import tarfile
import tempfile

from _expected_different import expected_different
import optuna
import pytest

pytestmark = [pytest.mark.conformance, pytest.mark.slow]

OPTUNA_TEST_FILES = (
    "tests/study_tests/test_study.py",
    "tests/study_tests/test_optimize.py",
    "tests/study_tests/test_dataframe.py",
    "tests/study_tests/test_multi_objective.py",
    "tests/test_callbacks.py",
    "tests/test_multi_objective.py",
    "tests/storages_tests/test_heartbeat.py",
    "tests/storages_tests/test_callbacks.py",
    "tests/trial_tests",
    "tests/pruners_tests",
)
"""Optuna's test files that reach ``Study.optimize``, relative to the sdist root."""

PROCESS_TEST_FILES = tuple(
    os.environ.get("WATERWAVE_CONFORMANCE_PROCESS_FILES", "tests/study_tests/test_study.py").split(
        ","
    )
)
"""The files run under ``isolation="process"``: by default ``test_study.py``, where Optuna tests
what ``optimize`` means (``test_optimize.py`` reaches no ``optimize`` in Optuna 5.0). One
executor serves the whole inner run (its K workers start once), yet a file of Optuna's tests
still takes minutes per K on the 2-core CI machine: more files would outgrow CI's budget.
``WATERWAVE_CONFORMANCE_PROCESS_FILES`` (comma-separated) runs others instead, e.g.
``tests/study_tests/test_study.py,tests/trial_tests``, whose differences
``_expected_different.py`` lists as they were seen."""


_HERE = Path(__file__).resolve().parent
_PYTEST_INI = """[pytest]
filterwarnings = ignore::optuna.exceptions.ExperimentalWarning
markers = slow: Optuna's slow tests
"""


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "waterwave-hpo" / "conformance"
    return Path(os.environ.get("WATERWAVE_CONFORMANCE_CACHE", default))


def _optuna_tests() -> Path:
    """The extracted ``tests/`` of the installed Optuna version's sdist, downloaded once."""
    version = optuna.__version__
    root = _cache_dir() / f"optuna-{version}"
    if (root / "tests" / "__init__.py").exists():
        return root
    download = _cache_dir() / "sdist"
    download.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        f"optuna=={version}",
        "-d",
        str(download),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    archives = sorted(download.glob(f"optuna-{version}.tar.gz"))
    if result.returncode != 0 or not archives:
        reason = (
            f"could not download Optuna {version}'s sdist (its tests) with {' '.join(command)}: "
            f"{result.stderr.strip()[-500:]}"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    # Extract beside the final place and rename: concurrent runs (K=1 and K=4 under
    # pytest-xdist) never see a half-extracted tree.
    staging = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
    prefix = f"optuna-{version}/"
    with tarfile.open(archives[0]) as archive:
        members = [
            m
            for m in archive.getmembers()
            if m.name.startswith(prefix + "tests/") and (m.isfile() or m.isdir())
        ]
        for member in members:
            member.name = member.name[len(prefix) :]
        archive.extractall(staging, members=members, filter="data")
    (staging / "pytest.ini").write_text(_PYTEST_INI, encoding="utf-8")
    try:
        staging.rename(root)
    except OSError:  # another run got there first
        shutil.rmtree(staging, ignore_errors=True)
    return root


def run_optuna_tests(
    k: int,
    report: Path,
    files: tuple[str, ...] = OPTUNA_TEST_FILES,
    isolation: str = "threads",
) -> dict:
    """Run Optuna's ``files`` with ``optimize`` through the executor at ``trials_per_device=k``.

    ``isolation`` is the executor's (``"threads"`` or ``"process"``).

    Returns:
        The plugin's report: ``outcomes`` (node id -> passed/failed/skipped/xfailed/xpassed)
        and ``reached_optimize`` (node ids that called ``Study.optimize``).
    """
    root = _optuna_tests()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_HERE), env.get("PYTHONPATH")]))
    # CI's subset: Optuna's storage-parametrized tests on the in-memory storage only ("all"
    # for every one of Optuna's STORAGE_MODES; a comma-separated list for some).
    env.setdefault("WATERWAVE_CONFORMANCE_STORAGES", "inmemory")
    env["WATERWAVE_CONFORMANCE_K"] = str(k)
    env["WATERWAVE_CONFORMANCE_ISOLATION"] = isolation
    env["WATERWAVE_CONFORMANCE_REPORT"] = str(report)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "_optuna_plugin",
        "--rootdir",
        str(root),
        "-c",
        str(root / "pytest.ini"),
        *files,
    ]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    if not report.exists():
        raise AssertionError(
            f"Optuna's tests did not run (exit {result.returncode}):\n{result.stdout[-4000:]}\n"
            f"{result.stderr[-4000:]}"
        )
    data: dict = json.loads(report.read_text(encoding="utf-8"))
    data["stdout"] = result.stdout
    return data


@pytest.mark.parametrize(
    ("isolation", "k"), [("threads", 1), ("threads", 4), ("process", 1), ("process", 4)]
)
def test_optuna_optimize_tests_pass_through_the_executor(
    isolation: str, k: int, tmp_path: Path
) -> None:
    files = PROCESS_TEST_FILES if isolation == "process" else OPTUNA_TEST_FILES
    data = run_optuna_tests(k, tmp_path / "report.json", files, isolation=isolation)
    outcomes: dict[str, str] = data["outcomes"]
    failed = sorted(
        node for node, outcome in outcomes.items() if outcome in ("failed", "collection error")
    )
    counts = {
        name: sum(1 for o in outcomes.values() if o == name) for name in set(outcomes.values())
    }
    summary = (
        f"{isolation}, K={k}: collected {len(outcomes)}, "
        f"reached optimize {len(data['reached_optimize'])}, {counts}"
    )
    print(summary)
    assert len(data["reached_optimize"]) > (50 if isolation == "process" else 100), summary
    # A process-wide function an objective patched and a race left patched (the plugin puts it
    # back after the test) comes only from a test expected to differ.
    expected = expected_different(k, isolation)
    leaks = [entry.split(": ")[0] for entry in data["restored_after"]]
    assert all(node.split("[")[0] in expected for node in leaks), data["restored_after"]
    assert not failed, (
        f"{summary}\n{len(failed)} of Optuna's tests fail through the executor and are not in "
        "_expected_different.py:\n" + "\n".join(failed) + "\n\n" + data["stdout"][-20000:]
    )
