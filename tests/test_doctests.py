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
    names = []
    for info in pkgutil.walk_packages(waterwave_hpo.__path__, "waterwave_hpo."):
        spec = importlib.util.find_spec(info.name)
        origin = spec.origin if spec is not None else None
        if origin and origin.endswith(".py") and ">>> " in Path(origin).read_text():
            names.append(info.name)
    return sorted(names)


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
