"""The installed package: its public names, and a clear error when imported from the checkout."""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path
import re
import subprocess
import sys
from typing import Any

import pytest

import waterwave_hpo as ww

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_public_api_is_exported() -> None:
    for name in (
        "WaterwaveExecutor",
        "create_study",
        "load_study",
        "current",
        "pipeline",
        "node_groups",
        "PipelineScheduler",
        "RayExecutor",
        "shared_gpu",
    ):
        assert name in ww.__all__, name
        assert getattr(ww, name) is not None


def _type_checking_names(module: Any) -> set[str]:
    """The names a facade imports under ``if TYPE_CHECKING:`` (what type checkers see)."""
    tree = ast.parse(Path(module.__file__).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, (ast.Import, ast.ImportFrom)), ast.unparse(statement)
                names |= {alias.asname or alias.name for alias in statement.names}
    return names


@pytest.mark.parametrize("name", ["waterwave_hpo", "waterwave_hpo.cluster"])
def test_a_lazy_facade_offers_what_type_checkers_see(name: str) -> None:
    module = importlib.import_module(name)
    seen = _type_checking_names(module)
    assert seen, "no TYPE_CHECKING block"
    assert seen == set(module.__dir__()), "the lazy names and the TYPE_CHECKING imports differ"
    for public in module.__all__:
        assert getattr(module, public) is not None, public
    eager = set(module.__all__) - seen
    assert all(public in vars(module) for public in eager), eager


def _python_output(code: str, cwd: Path) -> str:
    """What ``python -c code`` prints (stripped), run from ``cwd``: an empty folder, since at the
    repository root the checkout would be imported."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_importing_the_package_or_a_ray_actors_module_imports_no_torch(tmp_path: Path) -> None:
    """The storage relay's and the memory broker's actors and the command line import the
    package first: before the facade was lazy, that alone imported torch, 3.4 of the 4.3 CPU
    seconds of ``import waterwave_hpo`` on the 2-core VM."""

    def run(code: str) -> str:
        return _python_output(code, tmp_path)

    imported = run(
        "import sys, waterwave_hpo, waterwave_hpo.cluster._storage, waterwave_hpo.cluster._broker,"
        " waterwave_hpo.cli._main;"
        "print(sorted(m for m in ('torch', 'pandas', 'matplotlib') if m in sys.modules))"
    )
    assert imported == "[]"
    # The first use imports what the name needs.
    assert (
        run("import sys, waterwave_hpo as ww; ww.WaterwaveExecutor; print('torch' in sys.modules)")
        == "True"
    )


def test_a_shared_gpu_trials_imports_of_the_tune_integration_import_no_torch(
    tmp_path: Path,
) -> None:
    """A ``shared_gpu()`` trial's process imports the integration for its trainable and its
    resources: before the integration's names were imported on first use, that imported torch
    and the co-hosting machinery of ``tune_hosts()`` in every trial (6.3 CPU seconds each on the
    2-core VM)."""
    pytest.importorskip("ray.tune")
    code = (
        "import sys\n"
        "import waterwave_hpo.integrations.ray_tune as ww_tune\n"
        "names = ['shared_gpu', 'with_shared_gpu', 'lease_stats', 'SharedGPU', 'LeaseStats',\n"
        "         'MemoryLease', 'LeaseTimeoutError', 'HostStats', 'HostedTrialError']\n"
        "print(all(callable(getattr(ww_tune, n)) for n in names), 'torch' in sys.modules)\n"
        "print(ww_tune.tune_hosts.__module__, 'torch' in sys.modules)\n"
        "print(sorted(set(ww_tune.__all__) - set(dir(ww_tune))))\n"
        "try:\n"
        "    ww_tune.tune_host\n"
        "except AttributeError as error:\n"
        "    print(error)\n"
    )
    assert _python_output(code, tmp_path).splitlines() == [
        "True False",
        "waterwave_hpo.cluster._tune_hosts_api True",  # the first use imports what it needs
        "[]",
        "module 'waterwave_hpo.integrations.ray_tune' has no attribute 'tune_host'",
    ]


def _installed_editable() -> bool:
    # pip install -e: the imported sources are the checkout's own.
    # (REPO_ROOT itself may hold the venv, as the README's `.venv` does.)
    return Path(ww.__file__).resolve().is_relative_to(REPO_ROOT / "waterwave_hpo")


def test_importing_the_source_checkout_works_editable_or_says_how_to_fix_it(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", "import waterwave_hpo; waterwave_hpo.create_study"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if _installed_editable():
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode != 0
    assert "source checkout" in result.stderr
    assert "pip install -e ." in result.stderr
    assert "pip install ." in result.stderr


def test_the_pool_library_loads_in_a_regular_and_an_editable_install() -> None:
    from waterwave_hpo.memory import _lib

    path = _lib.library_path()
    assert path.is_file(), path
    _lib.load_library()
    if _installed_editable():  # sources in the checkout, the built library in site-packages
        assert not path.is_relative_to(REPO_ROOT / "waterwave_hpo")


@pytest.mark.slow
def test_an_editable_install_finds_the_pool_and_integrations_from_the_checkout(
    tmp_path: Path,
) -> None:
    # A contributor's loop: pip install -e . (in a fresh venv that sees this one's packages),
    # then import from the checkout. The build runs with pip's own isolation, as a user's does.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages")]
    (Path(site) / "_parent_env.pth").write_text("\n".join(ours) + "\n", encoding="utf-8")
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(REPO_ROOT)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if install.returncode != 0 and "Could not find a version" in install.stderr:
        pytest.skip(f"the build backend could not be fetched: {install.stderr[-300:]}")
    assert install.returncode == 0, install.stderr[-3000:]
    check = (
        "import waterwave_hpo, waterwave_hpo.integrations.optuna; "
        "from waterwave_hpo.memory import _lib; _lib.load_library(); "
        "print(waterwave_hpo.__file__)"
    )
    result = subprocess.run(
        [str(python), "-c", check], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert Path(result.stdout.strip()).resolve() == REPO_ROOT / "waterwave_hpo" / "__init__.py"


def _fenced_commands(text: str) -> list[str]:
    """The lines of the README's ```bash blocks."""
    blocks = text.split("```bash\n")[1:]
    return [line for block in blocks for line in block.split("```")[0].splitlines() if line]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_ci_runs_the_readmes_test_command_and_both_commands_pin_a_supported_torch() -> None:
    if not (REPO_ROOT / ".ci" / "run").is_file():
        pytest.skip("no .ci/run next to this test (an sdist)")
    commands = _fenced_commands((REPO_ROOT / "README.md").read_text())
    [test_command] = [c for c in commands if c.endswith(".venv/bin/pytest")]
    [demo_command] = [c for c in commands if c.endswith("waterwave-hpo demo")]
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines()  # exactly, as its own line
    # The README's command leaves the slow tests out (pyproject's addopts); CI runs them too.
    assert "-m 'not slow'" in (REPO_ROOT / "pyproject.toml").read_text()
    assert ".venv/bin/pytest -m slow" in ci.splitlines()
    pins = set(re.findall(r'"torch==([0-9.]+)"', test_command + demo_command))
    assert len(pins) == 1, pins  # the demo and the tests install the same torch
    spec = re.search(r'"torch>=([0-9.]+),<([0-9.]+)"', (REPO_ROOT / "pyproject.toml").read_text())
    assert spec is not None
    floor, cap = spec.groups()
    assert _version(floor) <= _version(pins.pop()) < _version(cap)
    # CI has a lane on the floor's minor release (any patch release: 2.9.1 for ">=2.9")
    assert re.search(rf'"torch=={re.escape(floor)}(\.[0-9]+)?"', ci)


def test_the_readme_and_install_page_state_the_torch_range_pyproject_accepts() -> None:
    spec = re.search(
        r'"torch>=([0-9.]+),<([0-9]+)\.([0-9]+)"', (REPO_ROOT / "pyproject.toml").read_text()
    )
    assert spec is not None
    floor, cap_major, cap_minor = spec.groups()
    accepted = (floor, f"{cap_major}.{int(cap_minor) - 1}")  # "<2.16": the newest is 2.15
    for page in ("README.md", "docs/install.md"):
        stated = re.findall(
            r"torch \(?([0-9]+\.[0-9]+) to ([0-9]+\.[0-9]+)", (REPO_ROOT / page).read_text()
        )
        assert stated, f"{page} states no torch range"
        assert set(stated) == {accepted}, (page, stated, accepted)
