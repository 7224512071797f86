"""The examples in the public docstrings run.

Every module of the installed package whose docstrings hold ``>>>`` examples is run through
:mod:`doctest`; a module with examples that is missing from the run fails the first test.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path
import pkgutil

import pytest

import waterwave_hpo


def _modules_with_examples() -> list[str]:
    # One name per file: an editable install's package path also holds the repository root,
    # where the same file is found again as waterwave_hpo.waterwave_hpo.<module>.
    by_file: dict[str, str] = {}
    for info in pkgutil.walk_packages(waterwave_hpo.__path__, "waterwave_hpo."):
        spec = importlib.util.find_spec(info.name)
        origin = spec.origin if spec is not None else None
        if origin and origin.endswith(".py") and ">>> " in Path(origin).read_text():
            key = str(Path(origin).resolve())
            if key not in by_file or len(info.name) < len(by_file[key]):
                by_file[key] = info.name
    return sorted(by_file.values())


MODULES = _modules_with_examples()


def test_the_public_examples_are_found() -> None:
    for expected in (
        "waterwave_hpo._checks",
        "waterwave_hpo.executor._executor",
        "waterwave_hpo.nodegroup._partition",
    ):
        assert expected in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
