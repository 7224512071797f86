"""Imports point down: mechanisms below the code that runs trials, the device side below the driver.

NodeGroup gates, memory plans, the pool and the scheduler read the running trial's context
from ``waterwave_hpo.trial``; the executor and the cluster, which run trials, build on them.
An import from one of these packages up into the executor (even under ``TYPE_CHECKING`` or
inside a function) closes a cycle; this AST check over the source tree finds any.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "waterwave_hpo"
# Each package below, with the packages it must never import.
BELOW = {
    "trial": (
        "executor",
        "host",
        "workers",
        "cluster",
        "nodegroup",
        "planning",
        "memory",
        "scheduler",
    ),
    "nodegroup": ("executor", "host", "workers", "cluster"),
    "planning": ("executor", "host", "workers", "cluster"),
    "memory": ("executor", "host", "workers", "cluster"),
    "scheduler": ("executor", "host", "workers", "cluster"),
    "relay": ("executor", "host", "workers", "cluster"),
    # The device side runs trials wherever they run (the driver's process, a worker process, a
    # Ray actor): it never imports the driver or a transport.
    "host": ("executor", "workers", "cluster"),
    # Process isolation's pipe (both ends): the driver imports it, never the other way.
    "workers": ("executor", "cluster"),
    # Ray's device side (host actors, Tune's hosted trials, the memory broker) runs trials in
    # other processes; only the driver's module, RayExecutor's, imports the driver.
    "cluster": ("executor",),
}
# The modules of a package in BELOW that are the driver's own and may import what it bans.
DRIVER_MODULES = {"cluster": frozenset({"_executor.py"})}


def upward_imports(source: str, own: str) -> list[tuple[int, str]]:
    """Each ``(line, module)`` of ``source`` (a module of package ``own``) that imports upward."""
    banned = tuple(f"waterwave_hpo.{above}" for above in BELOW[own])
    inside = tuple(f"{b}." for b in banned)
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        modules: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
            if node.module == "waterwave_hpo":
                modules += [f"waterwave_hpo.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        found += [(node.lineno, m) for m in modules if m in banned or m.startswith(inside)]
    return found


@pytest.mark.parametrize("own", sorted(BELOW))
def test_no_module_below_imports_the_code_that_runs_trials(own: str) -> None:
    reaches = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: imports {module}"
        for path in sorted((PACKAGE / own).rglob("*.py"))
        if path.name not in DRIVER_MODULES.get(own, frozenset())
        for line, module in upward_imports(path.read_text(), own)
    ]
    assert not reaches, "upward imports:\n" + "\n".join(reaches)


@pytest.mark.parametrize(
    ("source", "upward"),
    [
        ("def f():\n    from waterwave_hpo.executor import current_or_none\n", True),
        ("if TYPE_CHECKING:\n    from waterwave_hpo.host._planning import X\n", True),
        ("import waterwave_hpo.executor\n", True),
        ("from waterwave_hpo import executor\n", True),
        ("from waterwave_hpo.trial import current_or_none\n", False),
        ("from waterwave_hpo.executorish import x\n", False),
    ],
)
def test_the_check_sees_every_form_of_import(source: str, upward: bool) -> None:
    assert bool(upward_imports(source, "nodegroup")) is upward


def test_a_device_side_cluster_module_importing_the_driver_is_an_upward_import() -> None:
    # cluster/_hosted.py (Tune's trials co-hosted in an actor) once took TrialContext and
    # MemoryPoolMode from the driver's package; they live below it.
    assert upward_imports("from waterwave_hpo.executor import TrialContext\n", "cluster")
    assert not upward_imports("from waterwave_hpo.trial import TrialContext\n", "cluster")
