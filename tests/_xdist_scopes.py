"""pytest-xdist's ``--dist loadgroup``, kept working on pytest 9.2 and applied to module-scoped
fixtures too (``tests/conftest.py`` wires these hooks in).

xdist 3.8 groups the tests of an ``xdist_group`` by appending ``@group`` to their node ids in
the workers (``item._nodeid``), which pytest 9.2's ``Node.nodeid`` no longer reads: every test
becomes its own unit and a group's tests spread over all workers. Here each worker writes, once
it has collected, which unit every test belongs to (its ``xdist_group``; else its module's path
when it uses a class-, module- or package-scoped fixture, which each worker would otherwise
build again; else the test alone) to a file the controller named, and the controller's
scheduler (xdist's ``LoadScopeScheduling``: a unit's tests go to one worker, in order) reads it
and hands the units out in the collection's order, which ``sort_by_cost`` made the costliest
first from the durations of the last ``pytest --store-durations`` run (``durations.json``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import tempfile
from typing import Any

import pytest

_KEY = "waterwave_xdist_scopes"  # workerinput: the file the workers write the units to

DURATIONS = Path(__file__).with_name("durations.json")
"""Each test's duration in seconds (node id -> setup + call + teardown) from the last
``pytest --store-durations``: only the order in which units start depends on it."""
_TYPICAL_S = {"slow": 10.0, "quick": 0.3}  # a test not in DURATIONS (new, renamed)
_measured: dict[str, float] = {}  # this run's, by node id (the controller's reports)


def scope_of(item: pytest.Item) -> str:
    """The unit of work ``item`` belongs to: its group, its module, or itself."""
    groups = sorted(
        str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        for mark in item.iter_markers("xdist_group")
    )
    if groups:
        return "group:" + "_".join(groups)
    if _shares_a_fixture(item):
        return "module:" + item.nodeid.split("::")[0]
    return item.nodeid


def _shares_a_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        definitions[-1].scope in ("class", "module", "package")
        for definitions in info.name2fixturedefs.values()
        if definitions
    )


def _durations() -> dict[str, float]:
    try:
        data = json.loads(DURATIONS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def sort_by_cost(items: list[pytest.Item]) -> None:
    """Order ``items`` by their unit's cost, the costliest unit first, a unit's tests together
    in their collected order (every worker sorts its collection alike: xdist checks)."""
    durations = _durations()
    unit_of = {item.nodeid: scope_of(item) for item in items}
    cost: dict[str, float] = {}
    for item in items:
        typical = _TYPICAL_S["slow" if item.get_closest_marker("slow") else "quick"]
        unit = unit_of[item.nodeid]
        cost[unit] = cost.get(unit, 0.0) + durations.get(item.nodeid, typical)
    index = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(
        key=lambda item: (-cost[unit_of[item.nodeid]], unit_of[item.nodeid], index[item.nodeid])
    )


def record_duration(report: pytest.TestReport) -> None:
    _measured[report.nodeid] = _measured.get(report.nodeid, 0.0) + report.duration


def store_durations() -> None:
    """Write this run's durations over the stored ones (tests that did not run keep theirs)."""
    durations = _durations()
    durations.update({nodeid: round(s, 2) for nodeid, s in _measured.items()})
    DURATIONS.write_text(json.dumps(durations, indent=0, sort_keys=True) + "\n", encoding="utf-8")


def configure_node(node: Any) -> None:
    """Controller: tell a new worker where to write the units (one file per run)."""
    config = node.config
    path = getattr(config, "_waterwave_scopes_path", None)
    if path is None:
        handle, path = tempfile.mkstemp(prefix="waterwave-xdist-scopes-", suffix=".json")
        os.close(handle)
        config._waterwave_scopes_path = path
        config.add_cleanup(lambda: Path(path).unlink(missing_ok=True))
    node.workerinput[_KEY] = path


def write_scopes(session: pytest.Session) -> None:
    """Worker: write every collected test's unit (all workers collect the same tests)."""
    workerinput = getattr(session.config, "workerinput", None)
    if not workerinput or _KEY not in workerinput:
        return
    path = Path(workerinput[_KEY])
    scopes = {item.nodeid: scope_of(item) for item in session.items}
    staging = path.with_name(f"{path.name}.{workerinput['workerid']}")
    staging.write_text(json.dumps(scopes), encoding="utf-8")
    staging.replace(path)  # atomic: the controller never reads half a file


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Controller: xdist's scope scheduler over the units the workers wrote."""
    from xdist.scheduler import LoadScopeScheduling

    # Hand units out in the collection's order (sort_by_cost's), not xdist's by test count.
    config.option.loadscopereorder = False

    class UnitScheduling(LoadScopeScheduling):  # type: ignore[misc]
        _scopes: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._scopes is None:
                path = getattr(config, "_waterwave_scopes_path", None)
                text = Path(path).read_text(encoding="utf-8") if path else ""
                self._scopes = json.loads(text) if text else {}
            return self._scopes.get(nodeid, nodeid)

    return UnitScheduling(config, log)
