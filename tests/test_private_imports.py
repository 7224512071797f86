"""No private reaches across packages.

Each subpackage of ``waterwave_hpo`` offers what the others need through its facade
(``__init__.py``) or its one documented internal module (``_internal.py``); Optuna's internals
are touched only in ``waterwave_hpo/_optuna_compat.py``. This AST check over the source tree keeps
it so; it reads the files, it imports nothing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
import re

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "waterwave_hpo"
INTEGRATIONS = REPO_ROOT / "integrations"

# Project-wide private modules at the top of the package, shared by every subpackage.
SHARED_PRIVATE_MODULES = frozenset(
    {"_checks", "_experimental", "_optuna_compat", "_owned_files", "_version"}
)
# integrations/ray_tune.py is the public face of the cluster package's Ray Tune half; like a
# facade it only re-exports what it imports.
FACADE_OF = {"integrations": "cluster"}
# Attributes of Optuna objects that only _optuna_compat.py may read or write.
OPTUNA_PRIVATE_ATTRS = frozenset(
    {"_stop_flag", "_study_id", "_trial_id", "_thread_local", "_cached_frozen_trial"}
)


@dataclass(frozen=True)
class Reach:
    """One private reach: where, and what."""

    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _sources() -> Iterator[tuple[Path, str]]:
    """Each source file with the subpackage it belongs to ('' for the package's top level)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        yield path, parts[0] if len(parts) > 1 else ""
    for path in sorted(INTEGRATIONS.rglob("*.py")):
        yield path, "integrations"


def _allowed_import(own: str, module: str, names: list[str]) -> str | None:
    """Why ``from module import names`` in subpackage ``own`` is a private reach, or None."""
    parts = module.split(".")
    if parts[0] != "waterwave_hpo":
        return None
    if len(parts) == 1:
        bad = [n for n in names if n.startswith("_") and n not in SHARED_PRIVATE_MODULES]
        return f"private names {bad} of waterwave_hpo" if bad else None
    target = parts[1]
    if target in SHARED_PRIVATE_MODULES or target == own or FACADE_OF.get(own) == target:
        return None
    private = [p for p in parts[2:] if p.startswith("_") and p != "_internal"]
    if private:
        return f"{module} is private to {target}; use waterwave_hpo.{target} or its _internal"
    bad = [n for n in names if n.startswith("_") and not n.startswith("__")]
    return f"private names {bad} from {module}" if bad else None


def find_reaches() -> list[Reach]:
    """Every private import across subpackages and every reach into Optuna's internals."""
    reaches: list[Reach] = []
    for path, own in _sources():
        rel = str(path.relative_to(REPO_ROOT))
        tree = ast.parse(path.read_text(), filename=rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                why = _allowed_import(own, node.module, [a.name for a in node.names])
                if why:
                    reaches.append(Reach(rel, node.lineno, why))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    why = _allowed_import(own, alias.name, [])
                    if why:
                        reaches.append(Reach(rel, node.lineno, why))
            elif isinstance(node, ast.Attribute) and path.name != "_optuna_compat.py":
                on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
                if node.attr in OPTUNA_PRIVATE_ATTRS or (node.attr == "_storage" and not on_self):
                    reaches.append(
                        Reach(rel, node.lineno, f".{node.attr}: go through _optuna_compat")
                    )
    return reaches


def test_no_private_reaches_across_packages() -> None:
    reaches = find_reaches()
    assert not reaches, "private reaches:\n" + "\n".join(map(str, reaches))


@pytest.mark.parametrize(
    ("own", "module", "names", "reach"),
    [
        ("cluster", "waterwave_hpo.host._device_host", ["RunSettings"], True),
        ("cluster", "waterwave_hpo.executor", ["_streams"], True),
        ("cluster", "waterwave_hpo.executor._internal", ["Callback"], False),
        ("cluster", "waterwave_hpo.executor", ["WaterwaveExecutor"], False),
        ("cluster", "waterwave_hpo.cluster._fleet", ["HostFleet"], False),
        ("demo", "waterwave_hpo", ["_optuna_compat"], False),
        ("demo", "waterwave_hpo", ["_secret"], True),
        ("doctor", "waterwave_hpo.memory.testing", ["FakeStream"], False),
    ],
)
def test_the_rule_tells_a_reach_from_a_facade(
    own: str, module: str, names: list[str], reach: bool
) -> None:
    assert (_allowed_import(own, module, names) is not None) is reach


def test_the_rule_sees_a_stop_flag_set_outside_the_compat_module(tmp_path: Path) -> None:
    tree = ast.parse("def f(study):\n    study._stop_flag = True\n")
    attrs = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    assert set(attrs) & OPTUNA_PRIVATE_ATTRS == {"_stop_flag"}


def _documented_error_names() -> set[str]:
    """The error and warning classes the README and the manual name in code spans."""
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    pattern = re.compile(r"`(?:[\w.]+\.)?(\w+(?:Error|Warning))\b")
    return {name for page in pages for name in pattern.findall(page.read_text())}


def _public_names() -> set[str]:
    """The names in ``__all__`` of every public module (no private part in its path)."""
    names: set[str] = set()
    for path, _ in _sources():
        root = PACKAGE if path.is_relative_to(PACKAGE) else INTEGRATIONS
        parts = path.relative_to(root).parts
        if any(part.startswith("_") and part != "__init__.py" for part in parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
            ):
                names |= {ast.literal_eval(element) for element in node.value.elts}  # type: ignore[attr-defined]
    return names


def test_every_error_the_docs_name_is_importable_from_a_public_module() -> None:
    # A user reading "raises UnpicklableError" must be able to write `except ...` for it.
    defined = {
        node.name
        for path, _ in _sources()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    documented = _documented_error_names() & defined
    assert "UnpicklableError" in documented
    hidden = sorted(documented - _public_names())
    assert not hidden, f"named in the docs but exported by no public module: {hidden}"
