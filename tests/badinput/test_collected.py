"""The bad-input suite runs in CI: plain ``pytest`` collects it, and CI runs plain ``pytest``."""

from __future__ import annotations

from pathlib import Path
import re

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_plain_pytest_collects_tests_badinput() -> None:
    config = (REPO_ROOT / "pyproject.toml").read_text()
    assert re.search(r'^testpaths = \["tests"\]$', config, flags=re.MULTILINE)
    assert "badinput" not in config  # no --ignore, no norecursedirs naming it
    assert (REPO_ROOT / "tests" / "badinput" / "__init__.py").is_file()


def test_ci_runs_plain_pytest_over_the_whole_tree() -> None:
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    # Lane 1: ".venv/bin/pytest" with no path and no marker filter (testpaths applies).
    assert re.search(r"\.venv/bin/pytest\s*(&&|;|\n|$)", ci), ci
